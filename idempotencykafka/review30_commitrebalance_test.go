package idempotencykafka_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// The broker answers the group's first offset commit with
// REBALANCE_IN_PROGRESS, as Kafka does to a commit that arrives while the
// group is completing a rebalance. With franz-go's default balancer
// (cooperative-sticky) a member keeps its partitions across a rebalance,
// and here no rebalance even follows: the partition never moved.
//
// Before the fix: the consumer takes REBALANCE_IN_PROGRESS for "the
// partition moved" and drops the commit; the client goes on fetching from
// its position, so the records are never delivered again and their offset
// is never committed: the group's lag stays at 3 for as long as no new
// record arrives (and the records are read again at every restart).
//
// Now: a commit refused for a rebalance in progress once the poll's
// records are all done is given up, so that the rebalance may go ahead,
// and the partition is set back to the records: the member, which kept
// the partition, is delivered them again, replays them and commits their
// offsets in its next poll. The committed offset reaches 3.
func TestCommitRefusedDuringARebalanceIsTriedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	var asked atomic.Int64
	refuseCommits(w.cluster, "rip-group", kerr.RebalanceInProgress.Code, once(&asked))
	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "rip-group", "credits", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "the three records applied", func() bool { rows, _ := w.credits(t); return rows == 3 })
	waitFor(t, "the offsets are committed after the refusal", func() bool { return w.committed(t, "rip-group", "credits") == 3 })
	m.stop()
	require.Greater(t, asked.Load(), int64(1), "the refused commit was tried again")
}
