"""Composable mask-mod factories and the top-level mask shortcuts (owned by the mask work)."""


def document_mask(doc_ids, *, block_size=128):
    raise NotImplementedError


def document_causal_mask(doc_ids, *, block_size=128):
    raise NotImplementedError


def prefix_lm_mask(doc_ids, prefix_lengths, *, block_size=128):
    raise NotImplementedError
