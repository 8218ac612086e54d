"""The Tokenizer actor: text or chat messages in, validated token ids out.
"""
