"""Ship a cell as files: a cut sentence-transformers folder, a query/document pair, ONNX graphs and int8, each
checked against the model before it is kept."""
