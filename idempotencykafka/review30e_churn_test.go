package idempotencykafka_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Cooperative-sticky on 16 partitions: member A runs throughout; other
// members join and leave every few hundred ms for about 12 s while records
// arrive, some handlers slow, some failing a few times. Then the group is
// quiet. Every record's effect commits once, every partition's committed
// offset reaches its end, and no partition's committed offset is ever seen
// to fall back.
func TestReview30eCooperativeChurnAtSixteenPartitions(t *testing.T) {
	t.Parallel()
	churn(t, kgo.CooperativeStickyBalancer())
}

// The same with an eager balancer: every rebalance revokes everything.
func TestReview30eEagerChurnAtSixteenPartitions(t *testing.T) {
	t.Parallel()
	churn(t, kgo.RangeBalancer())
}

func churn(t *testing.T, balancer kgo.GroupBalancer) {
	const group, topic, n = "churn", "credits", 3200
	w := newWorld(t, 16, topic, topic+".dead-letter")

	var failsMu sync.Mutex
	fails := map[string]int{}
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		id := header(r, idempotencykafka.DefaultIDHeader)
		if rand.IntN(20) == 0 {
			select {
			case <-time.After(time.Duration(rand.IntN(40)) * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if rand.IntN(50) == 0 {
			failsMu.Lock()
			fails[id]++
			k := fails[id]
			failsMu.Unlock()
			if k <= 2 {
				return errTransientish
			}
		}
		return credit(ctx, tx, r)
	}
	opts := []idempotencykafka.Option{
		idempotencykafka.WithMaxPollRecords(50),
		idempotencykafka.WithCommitEvery(5),
		idempotencykafka.WithMaxAttempts(1000),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 50*time.Millisecond),
	}
	clientOpts := []kgo.Opt{kgo.Balancers(balancer), kgo.RebalanceTimeout(5 * time.Second), kgo.OnPartitionsLost(idempotencykafka.OnPartitionsLost)}

	// Watch for a committed offset that falls back.
	var fellBack atomic.Int64
	stopWatch := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		seen := map[int32]int64{}
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(30 * time.Millisecond):
			}
			for p, at := range w.committedByPartition(t, group, topic) {
				if at < seen[p] {
					fellBack.Add(1)
					t.Logf("partition %d's committed offset fell back from %d to %d", p, seen[p], at)
				}
				seen[p] = max(seen[p], at)
			}
		}
	}()

	a := w.startCustom(t, w.store, group, topic, handle, clientOpts, opts...)
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; i < n; i += 200 {
			w.produce(t, topic, amountsFrom(i, 200)...)
			time.Sleep(700 * time.Millisecond)
		}
	}()
	var others []*custom
	deadline := time.Now().Add(12 * time.Second)
	for time.Now().Before(deadline) {
		if len(others) < 3 && (len(others) == 0 || rand.IntN(2) == 0) {
			others = append(others, w.startCustom(t, w.store, group, topic, handle, clientOpts, opts...))
		} else {
			i := rand.IntN(len(others))
			others[i].stop()
			others = append(others[:i], others[i+1:]...)
		}
		time.Sleep(time.Duration(200+rand.IntN(300)) * time.Millisecond)
	}
	for _, o := range others {
		o.stop()
	}
	<-produced
	ends := w.ends(t, topic)
	waitForCount(t, "every partition committed to its end", n, w.committedOf(t, group, topic))
	a.stop()
	close(stopWatch)
	<-watched
	rows, distinct := w.credits(t)
	t.Logf("%d effects, %d distinct; fell back %d times", rows, distinct, fellBack.Load())
	assert.Equal(t, ends, w.committedByPartition(t, group, topic))
	assert.Zero(t, fellBack.Load(), "a committed offset fell back")
	require.Equal(t, n, rows, "one effect per record")
	require.Equal(t, n, distinct)
}

var errTransientish = &handlerErr{"the ledger hiccuped"}

type handlerErr struct{ s string }

func (e *handlerErr) Error() string { return e.s }
