"""Ship a cell: export (cut folder, ONNX, int8), the OpenAI-compatible server, and the budget-aware cell picker."""
