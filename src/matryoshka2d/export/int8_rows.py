"""int8 activations with one scale per row, so that a text's vector does not depend on what shares its call.

onnxruntime's dynamic quantization (`quantize_dynamic`) puts a DynamicQuantizeLinear before each MatMulInteger: one
scale and one zero point for the whole activation tensor, every text of the batch and its padding included. A text's
vector then depends on its neighbours: minilm-l6 at layer 6, 60 SciFact queries each alone and each in a call with
an abstract and another query, lowest cosine 0.986 (docs/benchmarks.md, "The same text, the same vector").

`scale_rows` rewrites such a graph so that each row of an activation (one token of one text) is quantized on its
own: symmetric, scale = max |row| / 127, stored as uint8 around the fixed zero point 128 (the operand type of the
kernels `quantize_dynamic` uses), and each matrix product becomes onnxruntime's MatMulIntegerToFloat with the
weights' per-channel scales, its float output multiplied by the rows' scales. A row's numbers then come from that
row and the weights only. The weights are `quantize_dynamic`'s as they were (int8, one scale per output channel).

The row scale is multiplied after MatMulIntegerToFloat rather than given as its `a_scale`: onnxruntime 1.32 fuses
MatMulInteger -> Cast -> Mul into MatMulIntegerToFloat reading only the first number of a non-scalar `a_scale`
(every row then takes the first row's scale: lowest cosine 0.52 on minilm-l6), and the operator's own `a_scale` is
a scalar.
"""

from __future__ import annotations

import numpy as np

ZERO_POINT = 128  # the uint8 rows are centred here: round(x / scale) lies in [-127, 127]
SMALLEST_SCALE = 1e-12  # a row of zeros: any scale gives zeros; this one avoids 0 / 0
PREFIX = "row_int8"  # names of the constants and values this rewrite adds
BLOCKED_QUANTIZE_OPSET = 21  # QuantizeLinear with a block along an axis (one scale per row) came in opset 21


class RowScaleError(ValueError):
    """A quantized graph holds a pattern the rewrite does not know: the message names the node."""


def scale_rows(model):
    """Rewrite `model` (an onnx ModelProto made by onnxruntime's quantize_dynamic, changed in place and returned)
    so that every dynamically quantized activation has one scale per row (see the module). A DynamicQuantizeLinear
    feeding anything but MatMulInteger -> Cast -> Mul (what quantize_dynamic writes for a MatMul with constant
    weights) raises RowScaleError: its scale would be the batch's again."""
    from onnx import helper

    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    weights = {i.name: i for i in graph.initializer}
    replaced: dict[int, list] = {}  # id(node) -> the nodes in its place (an empty list: removed)
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            continue
        quantized, scale, _zero_point = node.output
        products = consumers.get(quantized, [])
        for product in products:
            replaced.update(_row_product(helper, product, scale, producer, consumers, weights))
        widths = {int(weights[p.input[1]].dims[0]) for p in products}
        if len(widths) != 1:
            raise RowScaleError(
                f"node {node.name or quantized!r} (DynamicQuantizeLinear) feeds {len(products)} "
                f"matrix products of row widths {sorted(widths)}; one width is needed"
            )
        replaced[id(node)] = _row_quantization(helper, node.input[0], quantized, scale, widths.pop())
    nodes = [n for node in graph.node for n in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(_constants())
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, BLOCKED_QUANTIZE_OPSET)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _row_quantization(helper, x: str, quantized: str, scale: str, width: int) -> list:
    """`x` (float, rows of `width` numbers on the last axis) -> `quantized` (uint8 around ZERO_POINT) and `scale`
    (one per row): max |row| from the row's largest and smallest numbers (two reads, nothing written), then one
    QuantizeLinear with a block of the whole row (opset 21). Written as Abs, Div, Round, Add and Cast instead, the
    rows of a call of 64 abstracts cost 6x DynamicQuantizeLinear's time; the QuantizeLinear form, 1.1x."""

    def value(step: str) -> str:
        return f"{x}_{PREFIX}_{step}"

    return [
        helper.make_node("ReduceMax", [x, f"{PREFIX}_last_axis"], [value("max")], keepdims=1),
        helper.make_node("ReduceMin", [x, f"{PREFIX}_last_axis"], [value("min")], keepdims=1),
        helper.make_node("Neg", [value("min")], [value("negated_min")]),
        helper.make_node("Max", [value("max"), value("negated_min")], [value("largest")]),
        helper.make_node("Mul", [value("largest"), f"{PREFIX}_inverse_127"], [value("scale")]),
        helper.make_node("Max", [value("scale"), f"{PREFIX}_smallest_scale"], [scale]),
        helper.make_node("Shape", [scale], [value("shape")]),
        helper.make_node("Expand", [f"{PREFIX}_zero_point", value("shape")], [value("zero_points")]),
        helper.make_node("QuantizeLinear", [x, scale, value("zero_points")], [quantized], axis=-1, block_size=width),
    ]


def _row_product(helper, product, row_scale: str, producer, consumers, weights) -> dict[int, list]:
    """MatMulInteger(q, W, zp, W_zp) -> Cast -> Mul(Mul(scale, W_scale)) as MatMulIntegerToFloat(q, W, 1, W_scale,
    128, W_zp) -> Mul(row scale); the nodes replaced, by id."""
    where = f"node {product.name or product.output[0]!r} ({product.op_type})"
    if product.op_type != "MatMulInteger" or product.input[1] not in weights:
        raise RowScaleError(
            f"{where} reads a dynamically quantized activation; only MatMulInteger with constant "
            "weights can be given one scale per row"
        )
    (cast,) = _only(consumers, product.output[0], "Cast", where)
    (rescale,) = _only(consumers, cast.output[0], "Mul", where)
    scales = next(i for i in rescale.input if i != cast.output[0])
    scales_node = producer.get(scales)
    if scales_node is None or scales_node.op_type != "Mul" or row_scale not in scales_node.input:
        raise RowScaleError(f"{where}: its output is not multiplied by its input's scale times the weights' scales")
    weight_scale = next(i for i in scales_node.input if i != row_scale)
    weights, weight_zero_point = product.input[1], (product.input[3] if len(product.input) > 3 else "")
    unscaled = f"{product.output[0]}_{PREFIX}_float"
    out = {
        id(product): [
            helper.make_node(
                "MatMulIntegerToFloat",
                [product.input[0], weights, f"{PREFIX}_one", weight_scale, f"{PREFIX}_zero_point", weight_zero_point],
                [unscaled],
                domain="com.microsoft",
            ),
            helper.make_node("Mul", [unscaled, row_scale], [rescale.output[0]]),
        ],
        id(cast): [],
        id(rescale): [],
    }
    if all(c is rescale for c in consumers.get(scales, [])):  # the product of the scales is no longer read
        out[id(scales_node)] = []
    return out


def _only(consumers, name: str, op_type: str, where: str) -> list:
    found = consumers.get(name, [])
    if len(found) != 1 or found[0].op_type != op_type:
        raise RowScaleError(f"{where}: its output goes to {[n.op_type for n in found]}, not to one {op_type}")
    return found


def _constants() -> list:
    from onnx import numpy_helper

    values = {
        "last_axis": np.array([-1], np.int64),
        "inverse_127": np.array(1 / 127, np.float32),
        "smallest_scale": np.array(SMALLEST_SCALE, np.float32),
        "zero_point": np.array(ZERO_POINT, np.uint8),
        "one": np.array(1.0, np.float32),
    }
    return [numpy_helper.from_array(v, f"{PREFIX}_{k}") for k, v in values.items()]
