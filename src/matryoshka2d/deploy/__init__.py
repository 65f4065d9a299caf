"""Ship a cell: sentence-transformers folders and model cards, export (cut folder, ONNX, int8), and the server."""
