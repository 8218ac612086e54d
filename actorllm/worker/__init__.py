"""The Worker actor and what only it owns: the model runner, the packing of a plan
into tensors, the sampler and the tensor-parallel ranks.
"""
