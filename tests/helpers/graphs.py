"""ONNX graph caches in tests: a stand-in for the export that copies one graph built for real and counts calls."""

import shutil


class CountedExport:
    """Stands in for the export: copies the graph built once by the fixture (a real export takes seconds) and
    counts the calls, so a test sees whether the cache was used or rebuilt."""

    def __init__(self, graphs):
        (self.source,) = graphs.glob("weights-*/layer-2.onnx")
        self.calls = 0

    def __call__(self, encoder, layer, path):
        assert layer == 2
        self.calls += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.source, path)
        return path
