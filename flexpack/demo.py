"""`flexpack demo`: pack a bundled corpus, prove packed attention == per-document attention."""


def main(*, out: str = "flexpack-demo") -> int:
    print("flexpack demo: not implemented yet")
    return 0
