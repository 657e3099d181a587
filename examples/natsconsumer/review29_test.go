package natsconsumer

import (
	"fmt"
	"testing"
)

// A Consumer on a busy durable counts failures of messages that then
// succeed on another Consumer and never come back to it; their counts stay
// for staleAfter (at least an hour). Once maxTracked such counts are
// tracked within that hour, failed clears the whole map, the count of a
// message that fails on every delivery with it: that message's count
// starts over each time the map fills, so with enough other one-off
// failures (here 1500 between each of its deliveries) it never reaches
// WithMaxAttempts and is redelivered forever. Expected: its 10th failure
// is counted as its 10th (GaveUp), whatever else was tracked.
func TestMaxAttemptsReachedWhileManyOtherMessagesFail(t *testing.T) {
	c := &Consumer{opts: evaluateOptions(nil), failures: map[delivered]*failures{}}
	poison := delivered{"poison", 1}
	other := uint64(100)
	var n int
	for attempt := 1; attempt <= c.opts.maxAttempts; attempt++ {
		n = c.failed(poison)
		for range 1500 {
			other++
			c.failed(delivered{fmt.Sprintf("once-%d", other), other})
		}
	}
	if n != c.opts.maxAttempts {
		t.Fatalf("the poison message's failure number %d was counted as number %d: it is never given up", c.opts.maxAttempts, n)
	}
}
