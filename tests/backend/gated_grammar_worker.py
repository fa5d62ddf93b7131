"""A grammar worker (backend/grammar_worker.py) whose trials of constraints holding the text GRAMMAR_GATE_MARK
wait until the file GRAMMAR_GATE_RELEASE exists: a compile as slow as a test needs, in a real worker process
(tests/backend/test_structured_output.py)."""

from __future__ import annotations

import os
import sys
import time

from backend import grammar_worker


def main() -> None:
    mark, release = os.environ["GRAMMAR_GATE_MARK"], os.environ["GRAMMAR_GATE_RELEASE"]
    real = grammar_worker._trial_compiler

    def gated(inbox):
        compile_trial = real(inbox)

        def trial(spec):
            if mark in repr(spec):
                while not os.path.exists(release):
                    time.sleep(0.01)
            return compile_trial(spec)

        return trial

    grammar_worker._trial_compiler = gated
    grammar_worker.main(*map(int, sys.argv[1:]))


if __name__ == "__main__":
    main()
