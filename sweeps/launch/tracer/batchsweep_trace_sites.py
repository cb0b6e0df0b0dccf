"""Where the script made a call the tracer records: its caller's file and line outside torch and the tracer's own
files ("train.py:212"), each place numbered once, in the order first met."""
from __future__ import annotations

import os
import sys

TORCH = os.sep + "torch" + os.sep  # torch's folder, once it is imported: calls from inside it are not the script's
HERE = os.path.dirname(__file__)  # the tracer's files: a call made from them is not the script's


class Sites:
    def __init__(self):
        self.names: dict[str, int] = {}  # "file:line" of a call: its index
        # Each backward() names its place, so what is known of a code object (whether it is torch's or the
        # tracer's own) and of a place ((code, line, suffix): its index) is kept: a name costs a getcwd.
        self.places: dict = {}
        self.inside: dict = {}

    def index(self, suffix: str = "") -> int:
        """The index of the place of the call being made now, outside torch and the tracer."""
        frame, inside = sys._getframe(1), self.inside
        while frame is not None:
            known = inside.get(frame.f_code)
            if not (self._inside(frame.f_code) if known is None else known):
                break
            frame = frame.f_back
        place = frame and (frame.f_code, frame.f_lineno, suffix)
        index = self.places.get(place)
        if index is None:
            where = "?" if frame is None else f"{relative(frame.f_code.co_filename)}:{frame.f_lineno}{suffix}"
            index = self.places[place] = self.names.setdefault(where, len(self.names))
        return index

    def _inside(self, code) -> bool:
        inside = self.inside.get(code)
        if inside is None:
            name = code.co_filename
            inside = self.inside[code] = name.startswith(TORCH) or os.path.dirname(name) == HERE
        return inside


def relative(path: str) -> str:
    """A script's path as the user knows it: from the current folder where it is inside it."""
    here = os.getcwd() + os.sep
    return path[len(here):] if path.startswith(here) else path
