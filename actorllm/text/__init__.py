"""What the Tokenizer and the Worker both need of the vocabulary: the Hugging Face
tokenizer and grammars over it. Shared ground.
"""
