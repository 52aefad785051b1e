"""The front: a checkpoint folder, a GGUF file or the demo read into a model config and its weights (the readers
here), and the step graph each model family builds from them (families/)."""
