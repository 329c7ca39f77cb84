"""Decoding as pure parts: acceptance rules, the modes' proposers, the policy, costs.

- :mod:`~d3d.decoding.verify`    acceptance rules and :func:`~d3d.decoding.verify.accept`, the one
                                 place a round's logits become committed tokens
- :mod:`~d3d.sampling`            (below this package: the drafter's session uses it too)
                                 temperature / top-p distributions shared by drafter and target
- :mod:`~d3d.decoding.proposers` the modes as strategy objects (ar, sync; the protocol)
- :mod:`~d3d.decoding.policy`    ``auto``: speculate only where and as far as measured costs say
- :mod:`~d3d.decoding.lookup`    copy rounds: drafts copied from the request's own text
- :mod:`~d3d.decoding.rounds`    a round's bookkeeping, one protocol for both engines: what its
                                 proposer observes and what is recorded
- :mod:`~d3d.decoding.stats`     per-round records and per-request statistics (vLLM names)
- :mod:`~d3d.decoding.costs`     moving averages and fitted lines of measured costs
- :mod:`~d3d.backends.clock`     the one clock, synchronised with the devices
"""
