"""flexpack.attention: masked attention on every device (owned by the attention work)."""


def attention(q, k, v, mask, *, scale=None, enable_gqa=False, backend="auto"):
    raise NotImplementedError
