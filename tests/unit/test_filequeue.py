"""FileQueue answers as the deque it replaced (staging and push queues: an array with a cursor, issue 25)."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.daemon.staging.filequeue import FileQueue

ops = st.lists(st.tuples(st.sampled_from(["popleft", "appendleft", "extendleft", "append", "first"]),
                         st.integers(0, 999)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 999), max_size=12), ops)
def test_it_behaves_as_a_deque_of_the_same_files(start, seq):
    q, model = FileQueue(np.asarray(start, np.int32)), deque(start)
    for op, f in seq:
        if op == "popleft":
            if model:
                assert q.popleft() == model.popleft()
        elif op == "first":
            if model:
                assert q.first() == model[0]
        elif op == "extendleft":
            q.extendleft([f, f + 1])
            model.extendleft([f, f + 1])
        else:
            getattr(q, op)(f)
            getattr(model, op)(f)
        assert len(q) == len(model) and bool(q) == bool(model)
        assert list(q) == list(model)
        assert all(type(x) is int for x in q)  # (file indices, never numpy scalars, go on to dicts and sets)
