"""PackedBatch: per-token tensors of packed rows (owned by the packing work)."""


class PackedBatch:
    pass


def pack_sequences(sequences, max_len, **pack_kwargs):
    raise NotImplementedError
