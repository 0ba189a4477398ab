"""A run's checkpoints on the Hugging Face hub, one per revision, read in place from huggingface_hub's cache.

    relex ingest hf://ORG/REPO --revisions 'step_{1..75}' --base Qwen/Qwen2.5-Math-1.5B --out STORE

Published trajectories keep one checkpoint per branch (`step_1` … `step_75`). Each revision is fetched with
`snapshot_download` (weights, configs, tokenizer; nothing else) into the hub cache (HF_HUB_CACHE, by default
~/.cache/huggingface/hub), whose snapshot folder is a plain Hugging Face folder:

    models--ORG--REPO/refs/step_75                 the commit the branch points to
    models--ORG--REPO/snapshots/COMMIT/...         the files of that commit (links into blobs/)

The store then references those folders in place, so nothing is copied a second time. With HF_HUB_OFFLINE=1
nothing is downloaded: a revision the cache holds is used, any other fails in one line.
Step numbers come from the revision names (the digits that end `step_75`, `global_step_75`, `checkpoint-75`) or
from `--steps`, never from a model name.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from relex.errors import RelexError

LOG = logging.getLogger(__name__)

PREFIX = "hf://"
# what a checkpoint folder needs: weights, configs and tokenizer (a repository may hold optimizer states too)
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja"]
_REPO = re.compile(r"[\w.-]+/[\w.-]+")
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)(?:\.\.(\d+))?\}")


def is_hub_path(text: str | Path) -> bool:
    return str(text).startswith(PREFIX)


def parse_hub_path(text: str) -> tuple[str, str | None]:
    """`hf://ORG/REPO` or `hf://ORG/REPO@REVISION` -> (repo id, revision or None)."""
    repo, _, revision = str(text).removeprefix(PREFIX).partition("@")
    if not _REPO.fullmatch(repo):
        raise RelexError(f"{text}: not a hub repository; write hf://ORG/REPO (or hf://ORG/REPO@REVISION)")
    return repo, revision or None


def expand_revisions(text: str) -> list[str]:
    """`step_{1..75}` -> step_1 … step_75; `{0..100..25}` counts by 25; commas separate several (`main,step_{1..3}`)."""
    revisions: list[str] = []
    for part in (p.strip() for p in _split_outside_braces(text)):
        if not part:
            continue
        match = _RANGE.search(part)
        if match is None:
            if "{" in part or "}" in part:
                raise RelexError(f"--revisions {text!r}: cannot read {part!r}; write ranges like step_{{1..75}} or step_{{0..100..5}}")
            revisions.append(part)
            continue
        first, last, stride = int(match[1]), int(match[2]), int(match[3] or 1)
        if stride < 1 or last < first:
            raise RelexError(f"--revisions {text!r}: the range {match[0]} counts nothing; write it as {{FIRST..LAST}} with FIRST ≤ LAST")
        for n in range(first, last + 1, stride):
            revisions.extend(expand_revisions(part[: match.start()] + str(n) + part[match.end() :]))
    if not revisions:
        raise RelexError(f"--revisions {text!r} names no revision; give branch names like step_{{1..75}}")
    if len(set(revisions)) != len(revisions):
        raise RelexError(f"--revisions {text!r}: a revision is listed twice")
    return revisions


def _split_outside_braces(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def revision_step(revision: str) -> str:
    """The digits that end a revision's name (`step_75` -> "75"), the step it holds; refused when there are none."""
    match = re.search(r"[0-9]+$", revision)
    if match is None or re.fullmatch(r"[0-9a-f]{40}", revision):
        raise RelexError(
            f"revision {revision!r}: its name ends in no step number; give the steps of the revisions with --steps"
        )
    return match[0]


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cache folder of `repo_id` at `revision`, downloaded first unless HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{PREFIX}{repo_id}@{revision or 'main'}"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise RelexError(
            f"{where}: not in the hub cache {constants.HF_HUB_CACHE} and {why}; fetch it once with the network "
            "(unset HF_HUB_OFFLINE), or point HF_HUB_CACHE at a cache that holds it"
        ) from None
    LOG.debug("%s: %s", where, folder)
    return folder


def hub_revisions(paths: list[str | Path], revisions: list[str] | None) -> tuple[str, list[str]]:
    """(repo id, revision names) of the one `hf://ORG/REPO` in `paths`, with `--revisions` or its `@REVISION`."""
    if len(paths) != 1 or not is_hub_path(paths[0]):
        raise RelexError(f"--revisions reads one hub repository, hf://ORG/REPO; got {', '.join(map(str, paths))}")
    repo_id, pinned = parse_hub_path(str(paths[0]))
    if pinned is not None and revisions:
        raise RelexError(f"{paths[0]}: give the revisions either after @ or with --revisions, not both")
    if pinned is None and not revisions:
        raise RelexError(f"{paths[0]}: which revisions hold the steps? give them with --revisions, e.g. 'step_{{1..75}}'")
    return repo_id, revisions or [pinned]
