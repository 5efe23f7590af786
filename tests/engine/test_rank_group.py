"""The rank group's commands: declared on the worker class, run on rank 0 with what stays there,
refused when undeclared (the multi-rank paths: tests/plugins/backends/test_fsdp*.py)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch.distributed as dist

from grpo_core.engine.rank_group import Agreed, RankFailed, RankWorker, start_group


@attrs.define(eq=False)
class Doubler(RankWorker):
    calls: list[Any] = attrs.field(factory=list)

    def double(self, value: int, offset: int = 0) -> int:
        self.calls.append(value)
        return 2 * value + offset

    def refuse(self, message: str) -> None:
        self.agree(message)

    def fail(self) -> None:
        raise RuntimeError("out of memory")

    def undeclared(self) -> None:
        self.calls.append("undeclared")

    COMMANDS: ClassVar[tuple[Any, ...]] = (double, refuse, fail)


@pytest.fixture
def group():
    group = start_group(1, "cpu", spawn=True, worker=Doubler)
    yield group
    group.close()
    assert not dist.is_initialized()


def test_a_declared_command_runs_on_rank_0_with_what_stays_there(group):
    assert isinstance(group.local, Doubler) and group.local.rank == 0 and group.world == 1
    assert group.run(Doubler.double, 4, offset=1) == 9
    assert group.local.calls == [4]


def test_an_undeclared_command_is_refused_before_anything_is_sent(group):
    with pytest.raises(ValueError):
        group.run(Doubler.undeclared)
    assert group.local.calls == [] and group.broken is None
    assert group.run(Doubler.double, 1) == 2  # the group is still in step


def test_an_agreed_error_keeps_the_group_and_any_other_breaks_it(group):
    with pytest.raises(Agreed, match="bad checkpoint"):
        group.run(Doubler.refuse, "bad checkpoint")
    assert group.broken is None
    with pytest.raises(RankFailed, match="fail failed on rank 0 \\(RuntimeError: out of memory\\)"):
        group.run(Doubler.fail)
    with pytest.raises(RankFailed, match="fail failed on rank 0"):
        group.run(Doubler.double, 1)
    assert group.local.calls == []
