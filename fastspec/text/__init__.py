"""Text around the engine: the tokenizer and chat template, incremental detokenizing with stop strings, chat
sessions. The engine knows nothing of text."""
