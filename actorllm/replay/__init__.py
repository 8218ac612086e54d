"""actorllm.replay"""
