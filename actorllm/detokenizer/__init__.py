"""The Detokenizer actor: token ids in, text deltas out.
"""
