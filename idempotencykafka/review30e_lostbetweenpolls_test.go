package idempotencykafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Run waits in its poll (no records yet). The member is fenced: franz-go
// reports credits/0 lost (OnPartitionsLost), while Run is inside
// PollRecords, after its newPoll. The member rejoins and gets credits/0
// back in its next generation. Records arrive; the poll returns m-0..m-9
// of the new generation. m-3 waits (a downstream service down, a
// retryable error). Run is stopped then (a deploy), and started again on
// the same client, as Run's doc allows ("a Run stopped with records
// polled sets the client back to them").
//
// The promise: no record is skipped; m-3..m-9, left undone, are
// delivered again.
//
// The loss reported during the poll is kept as the poll's: the partition
// is taken for lost, so the poll neither commits m-0..m-2 nor sets the
// client back to m-3. The restarted Run is delivered m-10.. and commits
// past m-3..m-9, which nobody applied.
//
// With the classic protocol franz-go follows the loss with an error fetch
// that ends the poll (Run's next newPoll forgets the loss); with KIP-848
// (kgo.ServerSideBalancer), a FENCED_MEMBER_EPOCH heartbeat abandons the
// assignment (OnPartitionsLost) and rejoins, with no such fetch.
func TestReview30eLossReportedDuringThePollIsNotTheNewGenerations(t *testing.T) {
	t.Parallel()
	t.Run("classic", func(t *testing.T) {
		t.Parallel()
		lossDuringPoll(t, "lost-between", nil, func(w *world, group string, fenced *atomic.Bool) { fenceHeartbeats(w.cluster, group, fenced) })
	})
	t.Run("kip848", func(t *testing.T) {
		t.Parallel()
		lossDuringPoll(t, "lost-between-848", []kgo.Opt{kgo.ServerSideBalancer(), kgo.Balancers(kgo.RangeBalancer())}, fence848)
	})
}

// fence848 makes the broker answer the group's ConsumerGroupHeartbeats
// with FENCED_MEMBER_EPOCH while fenced is set.
func fence848(w *world, group string, fenced *atomic.Bool) {
	w.cluster.ControlKey(kmsg.ConsumerGroupHeartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		w.cluster.KeepControl()
		hb := req.(*kmsg.ConsumerGroupHeartbeatRequest)
		if hb.Group != group || !fenced.Load() {
			return nil, nil, false
		}
		resp := hb.ResponseKind().(*kmsg.ConsumerGroupHeartbeatResponse)
		resp.ErrorCode = kerr.FencedMemberEpoch.Code
		return resp, nil, true
	})
}

func lossDuringPoll(t *testing.T, group string, extra []kgo.Opt, fence func(*world, string, *atomic.Bool)) {
	w := newWorld(t, 1, "credits")
	var fenced atomic.Bool
	fence(w, group, &fenced)
	var lost, assigned atomic.Int64
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, "credits", append(extra,
		kgo.OnPartitionsLost(func(ctx context.Context, cl *kgo.Client, ps map[string][]int32) {
			idempotencykafka.OnPartitionsLost(ctx, cl, ps)
			lost.Add(1)
		}),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
			if len(ps["credits"]) > 0 {
				assigned.Add(1)
			}
		}))...)...)
	require.NoError(t, err)
	defer client.Close()

	var down atomic.Bool
	down.Store(true)
	downstream := errors.New("the ledger service is down")
	var m3Tries atomic.Int64
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-3" && down.Load() {
			m3Tries.Add(1)
			return downstream
		}
		return credit(ctx, tx, r)
	}
	c, err := idempotencykafka.New(w.store, client, handle,
		idempotencykafka.WithRetryable(func(err error) bool { return errors.Is(err, downstream) }),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond),
		idempotencykafka.WithErrorHandler(func(err error) { t.Logf("error: %.200v", err) }))
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, "the member has credits/0", func() bool { return assigned.Load() >= 1 })
	time.Sleep(300 * time.Millisecond) // Run is in its poll, waiting for records
	fenced.Store(true)
	waitFor(t, "the loss reported", func() bool { return lost.Load() >= 1 })
	fenced.Store(false)
	waitFor(t, "credits/0 assigned again", func() bool { return assigned.Load() >= 2 })

	w.produce(t, "credits", amounts(10)...)
	waitFor(t, "m-3 waits", func() bool { return m3Tries.Load() >= 3 })
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)

	down.Store(false)
	restarted, stop := context.WithCancel(context.Background())
	defer stop()
	done = make(chan error, 1)
	go func() { done <- c.Run(restarted) }()
	w.produce(t, "credits", amountsFrom(10, 5)...)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 15 })
	time.Sleep(time.Second)
	stop()
	<-done
	rows, distinct := w.credits(t)
	assert.Equal(t, 15, rows, "one effect per record: none skipped")
	assert.Equal(t, 15, distinct)
	_ = idempotency.OutcomeExecuted
}
