"""The model's tokenizer without torch, for the engine and the frontend alike: the tokenizer itself,
where a model source's files are, and stop-string matching over streamed text."""
