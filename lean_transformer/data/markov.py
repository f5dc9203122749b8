"""The embedded corpus: text sampled from a seeded sparse Markov chain over invented words, whose entropy rate is
computed exactly from its stationary distribution. A language model trained on it cannot get a loss below that
rate, so a run's loss can be read against its floor, with no download.

States are words plus one sentence-end state. A word's surface is a space and the word, the sentence end's is
".", so the text is uniquely decodable into states and its entropy per byte is the chain's entropy per state
divided by the expected number of bytes per state (both under the stationary distribution).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import numpy as np

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


@dataclass(frozen=True)
class MarkovCorpus:
    """A sparse Markov chain whose last state is the sentence end. ``successors[i]`` lists the states reachable
    from state i and ``probabilities[i]`` their probabilities."""

    words: tuple[str, ...]
    successors: tuple[np.ndarray, ...]
    probabilities: tuple[np.ndarray, ...]

    @classmethod
    def generate(cls, seed: int = 0, num_words: int = 400, branching: int = 6, sentence_end_probability: float = 0.1,
                 sentence_starts: int = 32) -> "MarkovCorpus":
        """A random chain: each word goes to ``branching`` random words (one of them the next word in a fixed cycle,
        which makes the chain irreducible) with Dirichlet(1) probabilities, or ends the sentence; a sentence starts
        with one of ``sentence_starts`` words."""
        rng = np.random.default_rng(seed)
        words: list[str] = []
        seen = set()
        while len(words) < num_words:
            syllables = rng.integers(1, 4)
            word = "".join(rng.choice(list(_CONSONANTS)) + rng.choice(list(_VOWELS)) for _ in range(syllables))
            if word not in seen:
                seen.add(word)
                words.append(word)
        end = num_words
        successors, probabilities = [], []
        for i in range(num_words):
            others = rng.choice(np.delete(np.arange(num_words), (i + 1) % num_words), branching - 1, replace=False)
            targets = np.concatenate([[(i + 1) % num_words], others, [end]])
            weights = rng.dirichlet(np.ones(branching)) * (1 - sentence_end_probability)
            successors.append(targets)
            probabilities.append(np.append(weights, sentence_end_probability))
        successors.append(rng.choice(num_words, sentence_starts, replace=False))
        probabilities.append(rng.dirichlet(np.ones(sentence_starts)))
        return cls(tuple(words) + (".",), tuple(successors), tuple(probabilities))

    @property
    def num_states(self) -> int:
        return len(self.words)

    def transition_matrix(self) -> np.ndarray:
        matrix = np.zeros((self.num_states, self.num_states))
        for i, (targets, probs) in enumerate(zip(self.successors, self.probabilities)):
            matrix[i, targets] = probs
        return matrix

    @cached_property
    def stationary_distribution(self) -> np.ndarray:
        """Solve pi P = pi with sum(pi) = 1 (unique: the chain is irreducible)."""
        system = self.transition_matrix().T - np.eye(self.num_states)
        system[-1] = 1.0
        rhs = np.zeros(self.num_states)
        rhs[-1] = 1.0
        return np.linalg.solve(system, rhs)

    def surface(self, state: int) -> str:
        return "." if state == self.num_states - 1 else " " + self.words[state]

    @property
    def entropy_per_state(self) -> float:
        """Entropy rate in nats per state: sum_i pi_i H(P[i, :])."""
        row_entropies = np.array([-(p * np.log(p)).sum() for p in self.probabilities])
        return float(self.stationary_distribution @ row_entropies)

    @property
    def bytes_per_state(self) -> float:
        lengths = np.array([len(self.surface(i).encode()) for i in range(self.num_states)])
        return float(self.stationary_distribution @ lengths)

    @property
    def entropy_per_byte(self) -> float:
        """The loss floor, in nats per token, of a byte-level language model trained on this corpus."""
        return self.entropy_per_state / self.bytes_per_state

    @cached_property
    def _cumulative_probabilities(self) -> tuple[np.ndarray, ...]:
        return tuple(np.cumsum(probs) for probs in self.probabilities)

    def sample_states(self, rng: np.random.Generator, start: int, length: int) -> np.ndarray:
        states = np.empty(length, dtype=np.int64)
        state = start
        for t, u in enumerate(rng.random(length)):
            cumulative = self._cumulative_probabilities[state]
            state = int(self.successors[state][min(np.searchsorted(cumulative, u), len(cumulative) - 1)])
            states[t] = state
        return states

    def documents(self, seed: int, states_per_document: int = 300) -> Iterator[str]:
        """An endless stream of documents: consecutive pieces of one trajectory started from the stationary
        distribution, so the stream as a whole is a stationary sample of the chain."""
        rng = np.random.default_rng(seed)
        state = int(rng.choice(self.num_states, p=self.stationary_distribution))
        while True:
            states = self.sample_states(rng, state, states_per_document)
            state = int(states[-1])
            yield "".join(map(self.surface, states)).lstrip()

    def log_likelihood(self, states: np.ndarray) -> float:
        """Sum of log P(s_t+1 | s_t) along a trajectory (for checking the entropy rate empirically)."""
        total = 0.0
        for current, following in zip(states[:-1], states[1:]):
            index = np.flatnonzero(self.successors[current] == following)
            total += math.log(self.probabilities[current][index[0]]) if len(index) else -math.inf
        return total
