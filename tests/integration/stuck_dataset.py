"""A dataset whose every sample hangs in preprocessing (loaded by path): a producer stuck in
the user's code, which no stream or message can interrupt."""

import time


class Stuck:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        time.sleep(3600)
        raise AssertionError("unreachable")


def make() -> Stuck:
    return Stuck()
