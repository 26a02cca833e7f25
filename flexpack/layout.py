"""PackedLayout: the one layout object for packed rows (owned by the packing work)."""


class PackedLayout:
    pass
