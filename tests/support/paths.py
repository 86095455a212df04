"""Where the tests find the repository and its fixtures on disk: the one definition of each path."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_TARGET = REPO_ROOT / "examples" / "reference-target"
EXAMPLES_DATA = REPO_ROOT / "examples" / "data"
TRAIN_SLICE = EXAMPLES_DATA / "draft_train_slice.jsonl"
RECIPES = REPO_ROOT / "recipes"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
# The training records: the full set on development machines, the bundled slice on a fresh clone.
TRAIN_DATA = SHARED_DATA / "draft_train.jsonl" if (SHARED_DATA / "draft_train.jsonl").exists() else TRAIN_SLICE
REFERENCE_AUX_LAYER_IDS = [2, 4, 5]  # [2, L//2, L-3] for the 8-layer reference target
