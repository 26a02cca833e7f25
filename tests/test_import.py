import flexpack


def test_public_names_import():
    for name in flexpack.__all__:
        assert hasattr(flexpack, name), name
