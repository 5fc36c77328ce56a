"""`kiln cache info` and `kiln cache clear`: the compile cache's place and size, or emptying it."""

from __future__ import annotations

import argparse


def add_arguments(commands) -> None:
    cache = commands.add_parser("cache", help="the compile cache: info (where, how big) or clear (delete it)")
    cache.add_argument("action", choices=["info", "clear"])


def run_command(args: argparse.Namespace) -> int:
    from kiln.compile_cache import CACHE_ENV, MAX_GB_ENV, CompileCache, cache_dir, max_bytes

    directory = cache_dir()
    if directory is None:
        print(f"the compile cache is off ({CACHE_ENV}={_env(CACHE_ENV)})")
        return 0
    cache = CompileCache(directory)
    if args.action == "clear":
        entries, size = cache.clear()
        print(f"deleted {entries} cached artifact(s), {size / 1e9:.2f} GB, from {directory}")
        return 0
    entries = cache.entries()
    print(
        f"compile cache {directory}: {len(entries)} artifact(s), {sum(s for _, s, _ in entries) / 1e9:.2f} GB "
        f"of at most {max_bytes() / 1e9:.1f} GB ({MAX_GB_ENV}); {CACHE_ENV}=off turns it off"
    )
    return 0


def _env(name: str) -> str:
    import os

    return os.environ.get(name, "")
