package natsconsumer

import (
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
