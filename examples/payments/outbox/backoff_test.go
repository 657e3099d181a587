package outbox

import (
	"testing"
	"time"
)

// The wait after the n-th failure is base doubled n-1 times, at most the
// cap, jittered to between half of that and all of it, for any n.
func TestBackoffDoublesUpToTheCapWithJitter(t *testing.T) {
	const base, limit = time.Second, 5 * time.Minute
	for n := 1; n <= 200; n++ {
		full := limit
		if n <= 9 { // 2^8 s = 256 s, the last step below 300 s
			full = base << (n - 1)
		}
		for range 50 {
			d := backoff(base, limit, n)
			if d < full/2 || d > full {
				t.Fatalf("backoff after %d failures = %v, want between %v and %v", n, d, full/2, full)
			}
		}
	}
	if d := backoff(time.Millisecond, time.Millisecond, 1<<30); d < time.Millisecond/2 || d > time.Millisecond {
		t.Fatalf("fixed backoff = %v, want between 0.5ms and 1ms", d)
	}
}
