package natsconsumer

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBackoffDoublesUpToMax(t *testing.T) {
	c := &Consumer{opts: evaluateOptions([]Option{WithRetryBackoff(100*time.Millisecond, time.Second)})}
	var got []time.Duration
	for n := uint64(1); n <= 6; n++ {
		got = append(got, c.backoff(n))
	}
	require.Equal(t, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond,
		800 * time.Millisecond, time.Second, time.Second}, got)
	require.Equal(t, time.Second, c.backoff(1<<40), "no overflow on a message delivered very often")
}

// It failed when a full table of failure counts was cleared whole: on a
// busy durable, where other consumers finish messages that failed once
// here, a message that fails on every delivery had its count reset each
// time the table filled and never reached WithMaxAttempts. Now the half
// seen least recently is forgotten.
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
