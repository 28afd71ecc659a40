"""A loss job's answer keys: its own work's whole key, every other work's, and
the model episodes that are one of them under another name.

A report is read against its own work's key and every other work's the
daemon keeps (a model may quote a screenplay it memorised that the operator
also trains on). A model episode that is a key -- linked, copied, or copied
with a byte changed, of its own work or another -- is never sent and never
archived (the archive allows the model's text: it must not be a key).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..core import dataset
from ..core.errors import RefusedError
from . import leakguard
from .leakguard_index import HumanIndex

# A model episode this much of whose word runs are a key's is a copy of it with
# something changed; a closed-book draft of the same story shares 0-0.4 % (data/example).
COPY_SHARE = 0.5
SAMPLE_EVERY = 8
MIN_SAMPLE = 64  # runs read at least, else all of them


def whole_key(files: dict[str, str], human: dict[int, str]) -> dict[int, str]:
    """Every key file by episode (two files of a number joined), and the range's
    text as it was read where the files, read again, do not hold it."""
    episodes = dataset.by_episode(files)
    for n, text in human.items():
        if text not in episodes.get(n, ""):
            episodes[n] = f"{episodes[n]}\n\n{text}" if n in episodes else text
    return episodes


def other_works(own: leakguard.HumanIndex) -> tuple[leakguard.HumanIndex, ...]:
    """Every other work's index the daemon keeps (none for a command run alone), one
    of each text: an index of the same episodes finds what the other finds."""
    keys = leakguard.installed()
    seen, others = {own.episode_digests}, []
    for index in keys.indexes if keys else ():
        if index.work != own.work and index.episode_digests not in seen:
            seen.add(index.episode_digests)
            others.append(index)
    return tuple(others)


def _sampled_runs(words: list[str], n: int) -> list[int]:
    """Every SAMPLE_EVERY-th n-word run, hashed as the index hashes them: a copy is
    a copy in any sample of its runs (hashing them all cost ~0.4 ms a job). A
    short episode has every run read: a stub opening with the key's title and
    first heading is not a copy for its one sampled run."""
    every = SAMPLE_EVERY if len(words) > MIN_SAMPLE * SAMPLE_EVERY else 1
    return [hash(tuple(words[i:i + n])) for i in range(0, len(words) - n + 1, every)]


def refuse_copies(scripts_dir: Path, model: dict[int, str], human_files: dict[str, str]) -> None:
    """A model episode with the content of a human episode file of its work (a hard
    link, a copy): refused, naming the file."""
    human_hashes = {dataset.sha256_text(text): name for name, text in human_files.items()}
    for n, text in sorted(model.items()):
        human_name = human_hashes.get(dataset.sha256_text(text))
        if human_name is not None:
            raise RefusedError(
                f"model episode {scripts_dir / dataset.episode_name(n)} has the content "
                f"of human {human_name} (a link to or copy of the answer key); not sent")


def refuse_near_copies(scripts_dir: Path, model: dict[int, str],
                       indexes: tuple[leakguard.HumanIndex, ...]) -> None:
    """A model episode that is mostly a key's text (a copy with a byte changed,
    another work's episode linked in): refused, naming the work and episode."""
    for n, text in sorted(model.items()):
        words = leakguard.tokens(text)
        runs: dict[int, list[int]] = {}  # n -> a sample of the episode's n-word runs
        for index in indexes:
            hashes = runs.setdefault(index.n, _sampled_runs(words, index.n))
            share, episode = copied_share(hashes, index)
            if share >= COPY_SHARE:
                raise RefusedError(
                    f"model episode {scripts_dir / dataset.episode_name(n)} is {share:.0%} "
                    f"the text of human {dataset.episode_name(episode)} of work "
                    f"{index.work} (a copy of its answer key); not sent")


def copied_share(hashes: Sequence[int], index: HumanIndex) -> tuple[float, int]:
    """How much of a text is the indexed key, from its n-word runs' hashes
    (shingle_hashes of its tokens, n = index.n): the share of them the key
    has, and the episode most of them come from. A copy of a key episode with
    a byte changed is ~1.0; a closed-book draft of the same story shares a
    few runs (data/example's draft: 0-0.4 %)."""
    episodes = [e for e in map(index.episode_of.get, hashes) if e is not None]
    if not episodes:
        return 0.0, 0
    return len(episodes) / len(hashes), max(set(episodes), key=episodes.count)
