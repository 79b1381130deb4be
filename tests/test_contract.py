"""``AsyncCheckpointIO`` holds a ``SaveSession``; Lightning's side reaches it through ``integration/contract.py``,
and the strategies declare their capabilities there (pure logic and the package's source: no process)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_asyncckpt
from lightning_asyncckpt import AsyncCheckpointIO, AsyncDDPStrategy, AsyncModelParallelStrategy
from lightning_asyncckpt.integration.contract import StrategyCapabilities, capabilities_of
from lightning_asyncckpt.integration.lightning_api import DDPStrategy
from lightning_asyncckpt.pipeline.pipeline import SaveSession

ROOT = Path(lightning_asyncckpt.__file__).parent
PLUGIN_NAMES = {"io", "_io", "plugin", "checkpoint_io"}  # what the package's modules call the plugin


def test_the_plugin_holds_its_session_and_has_at_most_15_public_methods_and_properties():
    ours = [c for c in AsyncCheckpointIO.__mro__ if c.__module__.startswith("lightning_asyncckpt")]
    assert ours == [AsyncCheckpointIO]  # no base class of ours: the session is held, not inherited
    own = sorted(n for n in vars(AsyncCheckpointIO) if not n.startswith("_"))
    assert len(own) <= 15, own
    io = AsyncCheckpointIO(timeout_s=10)
    assert isinstance(io.session, SaveSession) and io.settings is io.session.settings and io.history is io.session.history


def test_strategies_declare_their_capabilities_and_stock_ones_have_the_defaults():
    assert capabilities_of(AsyncDDPStrategy()) == StrategyCapabilities(all_ranks_write=True)
    assert capabilities_of(AsyncModelParallelStrategy()) == StrategyCapabilities(all_ranks_write=True,
                                                                                 own_state_layout=True)
    assert capabilities_of(DDPStrategy()) == StrategyCapabilities() == capabilities_of(None)


def test_no_module_sets_an_attribute_of_the_plugin_or_reads_a_private_class_flag():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        if "_asyncckpt_" in source:
            found.append(f"{path.relative_to(ROOT)}: reads an _asyncckpt_ flag")
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                owner = target.value if isinstance(target, ast.Attribute) else None
                name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
                if name in PLUGIN_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: sets {name}.{target.attr}")
    assert not found, found
