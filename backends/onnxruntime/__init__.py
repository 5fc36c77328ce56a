"""The ONNX Runtime backend (being built): IR -> ONNX ModelProto -> InferenceSession."""
