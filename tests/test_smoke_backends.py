from throttle_client.testing import FakeClock


def test_two_per_second_then_wait(make_limiter):
    clock = FakeClock()
    limiter = make_limiter(rates=["2/second"], min_interval=0.1, clock=clock)
    assert limiter.try_acquire("token").allowed
    refused = limiter.try_acquire("token")
    assert not refused.allowed and refused.retry_after == 0.1
    clock.advance(0.1)
    assert limiter.try_acquire("token").allowed
    decision = limiter.acquire("token")
    assert decision.waited == 0.9
    assert clock.slept == [0.9]
