"""Seed lists for sampling: '0-49999', '0,5,7', '0-9,20-29' -> [0, 1, ...]."""
from tread_utils.errors import UserError

MAX_SEED = 2 ** 63 - 1


def parse_seeds(spec) -> list:
    """'0-49999', '0,5,7', '0-9,20-29', an int, or a list of ints / such strings -> list of seeds, in order.

    Ranges are inclusive. Seeds are non-negative integers, each at most once.
    """
    parts = [spec] if isinstance(spec, (str, int)) else list(spec)
    seeds = []
    for part in parts:  # an int is read as its digits (so True, -5 and 1.5 are refused as unreadable)
        for item in str(part).replace(" ", "").split(","):
            lo, sep, hi = item.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise UserError(f"seeds: cannot read {item!r} in {spec!r}; write seeds like 0-49999, 0,5,7 or "
                                f"0-9,20-29 (non-negative integers, inclusive ranges)")
            lo_i, hi_i = int(lo), int(hi) if sep else int(lo)
            if hi_i < lo_i:
                raise UserError(f"seeds: range {item!r} ends before it starts")
            if hi_i > MAX_SEED or hi_i - lo_i >= 100_000_000:
                raise UserError(f"seeds: range {item!r} is too large")
            seeds.extend(range(lo_i, hi_i + 1))
    if not seeds:
        raise UserError(f"seeds: {spec!r} names no seed")
    seen = set()
    for seed in seeds:
        if seed in seen:
            raise UserError(f"seeds: seed {seed} appears more than once; duplicate seeds give duplicate samples")
        seen.add(seed)
    return seeds
