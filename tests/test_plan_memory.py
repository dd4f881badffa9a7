"""The pre-flight's memory decision: jax's pool (``bytes_limit``) and the card, numbers injected."""

from __future__ import annotations

import pytest

from dflash_jax.tools import plan

GIB = 2**30
H100_CARD = 81559 * 2**20  # what an H100 80 GB reports as its total memory
NO_ENV: dict = {}


def test_a_step_within_the_pool_fits_and_needs_no_advice():
    m = plan.check_memory(50 * GIB, pool=int(0.75 * H100_CARD), card=H100_CARD, env=NO_ENV)
    assert m.fits is True and m.status == "fits" and m.limit == m.pool
    assert m.advice() is None


def test_a_step_over_the_pool_that_the_card_holds_is_told_the_fraction_to_set():
    """The recommended qwen3-8b plan (69.93 GiB) on an 80 GB card with jax's default pool."""
    peak, card = int(69.93 * GIB), H100_CARD
    m = plan.check_memory(peak, pool=int(0.75 * card), card=card, env=NO_ENV)
    assert m.fits is False and m.status == "needs a larger pool"
    # The advised pool holds the peak with headroom, and 0.01 less would not.
    assert m.fraction * card >= peak + m.headroom > (m.fraction - 0.01) * card
    assert m.headroom >= 0.05 * peak
    assert m.fraction <= plan.MAX_POOL_FRACTION
    assert m.setting() == "XLA_CLIENT_MEM_FRACTION=0.93"
    assert "XLA_CLIENT_MEM_FRACTION=0.93" in m.advice()


def test_a_step_over_the_card_is_refused_without_a_pool_setting():
    m = plan.check_memory(78 * GIB, pool=int(0.75 * H100_CARD), card=H100_CARD, env=NO_ENV)
    assert m.fits is False and m.status == "does not fit"
    assert m.fraction > plan.MAX_POOL_FRACTION
    advice = m.advice()
    assert "micro_batches" in advice and "XLA_CLIENT_MEM_FRACTION=" not in advice


def test_nothing_known_refuses_nothing():
    m = plan.check_memory(10**15, pool=None, card=None, env=NO_ENV)
    assert m.fits is None and m.status == "unknown" and m.fraction is None
    assert m.advice() is None


def test_a_pool_without_a_known_card_is_compared_and_names_the_variable():
    m = plan.check_memory(70 * GIB, pool=60 * GIB, card=None, env=NO_ENV)
    assert m.fits is False and m.status == "does not fit"
    assert "XLA_CLIENT_MEM_FRACTION" in m.advice()


@pytest.mark.parametrize(
    "peak_gib,note",
    [(50, None), (69.93, "XLA_CLIENT_MEM_FRACTION=0.93"), (79, "may run out of memory")],
)
def test_planning_for_a_card_says_what_its_pool_must_be(peak_gib, note):
    """CPU with --device-memory: no pool; the peak is compared with the card as before, and the
    pool the GPU will need is named when jax's default 75 % is short."""
    m = plan.check_memory(int(peak_gib * GIB), pool=None, card=H100_CARD, env=NO_ENV)
    assert m.fits is True and m.limit == H100_CARD
    if note is None:
        assert m.advice() is None
    else:
        assert note in m.advice()


def test_the_deprecated_variable_is_advised_where_the_user_sets_it():
    """jax refuses both names at once: advise the one already in use."""
    args = dict(pool=int(0.8 * H100_CARD), card=H100_CARD)
    m = plan.check_memory(int(69.93 * GIB), **args, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"})
    assert m.setting() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.93"
    m = plan.check_memory(int(69.93 * GIB), **args, env={"XLA_CLIENT_MEM_FRACTION": "0.8"})
    assert m.setting() == "XLA_CLIENT_MEM_FRACTION=0.93"


def test_cpu_devices_report_no_pool_and_no_card():
    import jax

    assert plan.read_device_memory(jax.devices()[:2]) == (None, None)
    assert plan.read_device_memory(jax.devices()[:2], 80 * GIB) == (None, 80 * GIB)
