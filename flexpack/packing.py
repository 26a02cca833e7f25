"""Packing: assign variable-length samples to rows of max_len (owned by the packing work)."""


class PackStats:
    pass


class PackPlan:
    pass


def pack(lengths, max_len, *, strategy="bfd", overflow="error", seed=0, max_docs_per_row=None):
    raise NotImplementedError
