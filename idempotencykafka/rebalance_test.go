package idempotencykafka_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A group of two members. The second joins while the first has applied
// records whose offsets it has not committed, and is stuck (its handler
// holds it past the group's rebalance timeout): the group moves its
// partitions to the second member, which is delivered those records again
// and replays them. Each of 2,000 records' effects commits once.
func TestEachRecordOnceAcrossARebalance(t *testing.T) {
	t.Parallel()
	const n = 2000
	w := newWorld(t, 4, "credits")
	records := amounts(n)
	w.produce(t, "credits", records[:n/2]...)
	// The group waits this long for a member to rejoin before it drops it.
	fastRebalance := []kgo.Opt{kgo.RebalanceTimeout(time.Second)}

	var aExecuted atomic.Int64
	release := make(chan struct{})
	a := w.startMemberWith(t, memberConfig{store: w.store, client: fastRebalance, onOutcome: func(o idempotency.Outcome) {
		if o == idempotency.OutcomeExecuted && aExecuted.Add(1) >= n/8 {
			<-release // applied, its offset not committed
		}
	}}, "credits-group", "credits")
	waitFor(t, "member a applies some and is stuck", func() bool { return aExecuted.Load() >= n/8 })
	b := w.startMemberWith(t, memberConfig{store: w.store, client: fastRebalance}, "credits-group", "credits")
	waitFor(t, "the group drops member a and gives member b its partitions", func() bool { return b.replayed.Load() > 0 })
	close(release)
	w.produce(t, "credits", records[n/2:]...)
	waitForCount(t, "every offset committed", n, w.committedOf(t, "credits-group", "credits"))
	a.stop()
	b.stop()

	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record")
	require.Equal(t, n, distinct)
	require.Positive(t, b.replayed.Load(), "member b was delivered records member a had applied")
	require.EqualValues(t, n, a.executed.Load()+b.executed.Load(), "executions across both members")
	t.Logf("a executed %d, replayed %d; b executed %d, replayed %d", a.executed.Load(), a.replayed.Load(), b.executed.Load(), b.replayed.Load())
}

// A record whose ID is held by someone else (the member that had its
// partition before a rebalance, still applying it) is waited for, never
// skipped: the consumer commits its offset only once the holder committed,
// and then replays the holder's outcome.
func TestRecordHeldElsewhereIsWaitedForNeverSkipped(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	store, err := idempotency.NewStore(w.db.Pool, idempotency.WithInProgressWait(20*time.Millisecond))
	require.NoError(t, err)
	r := rec("m-1", "acct-1", "100")
	w.produce(t, "credits", r, rec("m-2", "acct-1", "5"))

	// The other member: holds m-1 until told to commit.
	release, held := w.holdID(t, store, "held-group", "credits", r)

	m := w.startMemberOn(t, store, "held-group", "credits", idempotencykafka.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond))
	waitFor(t, "the consumer finds m-1 held", func() bool { return m.inProgress.Load() >= 3 })
	require.Zero(t, w.committed(t, "held-group", "credits"), "nothing committed past the held record")
	rows, _ := w.credits(t)
	require.Zero(t, rows, "m-2 waits behind m-1: a partition keeps its order")
	release()
	require.NoError(t, <-held)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "held-group", "credits") == 2 })
	m.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, rows)
	require.Equal(t, 2, distinct)
	require.EqualValues(t, 1, m.replayed.Load(), "m-1: the holder's effect, replayed")
	require.EqualValues(t, 1, m.executed.Load(), "m-2")
}

// Member A's record of partition 0 waits to be tried again (a handler
// error WithRetryable names: a downstream service is down) while B joins
// the group. With kgo.BlockRebalanceOnPoll the rebalance waits for A's
// poll, here for as long as the record waits: A's rebalance timeout is 10
// minutes, and B gets nothing in the meantime.
//
// With kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked)
// A's poll is told that a rebalance waits: the record stops waiting and is
// left undone, the poll's done records are committed, the rebalance goes
// ahead and B gets partitions. Once the downstream service is back, the
// record is applied, once.
func TestARebalanceWaitingForAPollEndsItsWaits(t *testing.T) {
	t.Parallel()
	const group = "hurried"
	w := newWorld(t, 2, "credits")
	var down atomic.Bool
	down.Store(true)
	downstream := errors.New("the ledger service is down")
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-0" && down.Load() {
			return downstream
		}
		return credit(ctx, tx, r)
	}
	retryable := idempotencykafka.WithRetryable(func(err error) bool { return errors.Is(err, downstream) })
	w.produce(t, "credits", amounts(10)...)
	var tries atomic.Int64
	a := w.startCustom(t, w.store, group, "credits", handle, []kgo.Opt{kgo.RebalanceTimeout(10 * time.Minute)}, retryable,
		idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, _ idempotency.Outcome, _ error) {
			if r.Offset == 0 && r.Partition == 0 {
				tries.Add(1)
			}
		}))
	waitFor(t, "the waiting record tried", func() bool { return tries.Load() >= 3 })

	b := w.startMember(t, group, "credits")
	waitFor(t, "B got a partition while the record still waits", func() bool { return b.assigned.Load() > 0 })
	down.Store(false)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 10 })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 10, rows, "one effect per record")
	require.Equal(t, 10, distinct)
}

// m-0's ID is held by another holder (the member that had the partition,
// still applying it). A's store waits for a held ID for up to 10 minutes
// (idempotency.WithInProgressWait, a store shared with a gRPC server whose
// handlers are long). A's rebalance timeout is 10 minutes. B joins.
//
// OnPartitionsCallbackBlocked's doc: a record that waits ("its ID held by
// another member") stops waiting once a rebalance waits for the poll, and
// the poll lets the rebalance go ahead. The wait for the held ID happens
// inside ProcessMessage, on the poll's context, which the signal does not
// end: B got nothing for as long as the ID was held. The test requires that
// B gets a partition within 45 s while the ID is still held, and that both
// records are then applied once.
func TestRebalanceGoesAheadWhileARecordWaitsForAHeldID(t *testing.T) {
	t.Parallel()
	const group = "held-long"
	w := newWorld(t, 2, "credits")
	calls := &startCounter{key: "m-0"}
	store, err := idempotency.NewStore(w.db.Pool, idempotency.WithInProgressWait(10*time.Minute), idempotency.WithTracer(calls))
	require.NoError(t, err)
	r := rec("m-0", "acct-0", "1")
	w.produce(t, "credits", r, rec("m-1", "acct-1", "2"))

	release, held := w.holdID(t, store, group, "credits", r)

	a := w.startCustom(t, store, group, "credits", credit, []kgo.Opt{kgo.RebalanceTimeout(10 * time.Minute)})
	// A's poll may hold m-1 too, or not: a poll's partitions wait for one
	// another, so m-1 may wait behind m-0 until the ID is released. What
	// the test needs is A in m-0's call, waiting for its ID, when B joins.
	waitFor(t, "A began m-0's call", func() bool { return calls.n.Load() >= 2 }) // the holder's, then A's
	b := w.startMember(t, group, "credits")
	deadline := time.Now().Add(45 * time.Second)
	for b.assigned.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	assert.Positive(t, b.assigned.Load(), "B got a partition while m-0's ID was held (45 s)")

	release()
	require.NoError(t, <-held)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 2 })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, rows)
	require.Equal(t, 2, distinct)
}

// Member A polls 40 records of two partitions (20 each); its handler takes
// 100 ms per record (a slow downstream call that succeeds), so the poll's
// work is about 2 s per partition. A's rebalance timeout is 10 minutes.
// Member B joins while A is at its first few records. franz-go tells A
// (OnPartitionsCallbackBlocked) that a rebalance waits for its poll.
//
// The promise (OnPartitionsCallbackBlocked's doc): "an attempt under way
// ends (its effect committed or rolled back), no other begins", and the
// poll lets the rebalance go ahead. So between the signal and A's revoke
// callback (which runs only once the poll allowed the rebalance, eager
// balancer) at most one record per partition may begin.
//
// The test counts the handler calls that began after the signal and
// before the revoke.
func TestHurriedPollBeginsAtMostOneRecordPerPartition(t *testing.T) {
	t.Parallel()
	const group, n = "hurry-new-records", 40
	w := newWorld(t, 2, "credits")
	w.produce(t, "credits", amounts(n)...)

	var begun, begunAtSignal, begunAtRevoke atomic.Int64
	begunAtSignal.Store(-1)
	begunAtRevoke.Store(-1)
	var signalled atomic.Bool
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		begun.Add(1)
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return credit(ctx, tx, r)
	}
	a := w.startCustom(t, w.store, group, "credits", handle, []kgo.Opt{
		kgo.RebalanceTimeout(10 * time.Minute),
		kgo.Balancers(kgo.RangeBalancer()),
		kgo.OnPartitionsCallbackBlocked(func(ctx context.Context, cl *kgo.Client) {
			if signalled.CompareAndSwap(false, true) {
				begunAtSignal.Store(begun.Load())
			}
			idempotencykafka.OnPartitionsCallbackBlocked(ctx, cl)
		}),
		kgo.OnPartitionsRevoked(func(context.Context, *kgo.Client, map[string][]int32) {
			if signalled.Load() {
				begunAtRevoke.CompareAndSwap(-1, begun.Load())
			}
		}),
	})
	waitFor(t, "A began its first records", func() bool { return begun.Load() >= 4 })
	b := w.startMemberWith(t, memberConfig{store: w.store, client: []kgo.Opt{kgo.Balancers(kgo.RangeBalancer())}}, group, "credits")
	waitFor(t, "A's poll allowed the rebalance", func() bool { return begunAtRevoke.Load() >= 0 })
	t.Logf("handler calls begun: %d at the signal, %d when the poll allowed the rebalance", begunAtSignal.Load(), begunAtRevoke.Load())
	assert.LessOrEqual(t, begunAtRevoke.Load()-begunAtSignal.Load(), int64(2),
		"records begun by A's poll after it was told a rebalance waits (at most one per partition, racing the signal)")

	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == n })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows)
	require.Equal(t, n, distinct)
}

// 16 partitions: member A runs throughout; other members join and leave
// every few hundred ms for about 12 s while records arrive, some handlers
// slow, some failing a few times. Then the group is quiet. Every record's
// effect commits once, every partition's committed offset reaches its end,
// and no partition's committed offset is ever seen to fall back. With
// cooperative-sticky a member keeps its partitions across a rebalance;
// with an eager balancer every rebalance revokes everything.
func TestChurnAtSixteenPartitions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		balancer kgo.GroupBalancer
	}{
		{"cooperative-sticky", kgo.CooperativeStickyBalancer()},
		{"eager", kgo.RangeBalancer()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			churn(t, tc.balancer)
		})
	}
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

// startCounter is a tracer that counts the calls of a key that began.
type startCounter struct {
	key string
	n   atomic.Int64
}

func (c *startCounter) TraceCallStart(ctx context.Context, d idempotency.TraceCallStartData) context.Context {
	if strings.Contains(d.Key, c.key) {
		c.n.Add(1)
	}
	return ctx
}

func (c *startCounter) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {}
