# a class answer whose base names dtlib.__main__: the verdict imported it (and ran dtlib's CLI) to rebuild the base
class _Base:
    pass
_Base.__module__, _Base.__qualname__ = "dtlib.__main__", "main"
class double(_Base):
    pass
