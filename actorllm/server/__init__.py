"""actorllm.server"""
