"""Emulated vendor drivers (filled in by the Ascend/MLU work)."""


class NotBuildable(Exception):
    pass


def backend_for(platform):
    raise NotBuildable(f"no emulated {platform} driver yet")
