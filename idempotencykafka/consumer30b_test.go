package idempotencykafka_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// refuseCommits makes the broker answer the group's offset commits with
// code while refuse, asked once per commit, says so.
func refuseCommits(cluster *kfake.Cluster, group string, code int16, refuse func() bool) {
	refuseCommitsOf(cluster, group, code, func(*kmsg.OffsetCommitRequest) bool { return refuse() })
}

// refuseCommitsOf is refuseCommits with refuse told which commit it is
// asked about.
func refuseCommitsOf(cluster *kfake.Cluster, group string, code int16, refuse func(*kmsg.OffsetCommitRequest) bool) {
	answerCommits(cluster, group, func(req *kmsg.OffsetCommitRequest) int16 {
		if refuse(req) {
			return code
		}
		return 0
	})
}

// answerCommits makes the broker answer each of the group's offset
// commits with the error code answer gives it, for every partition; 0
// lets the broker handle the commit.
func answerCommits(cluster *kfake.Cluster, group string, answer func(*kmsg.OffsetCommitRequest) int16) {
	cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != group {
			return nil, nil, false
		}
		code := answer(commit)
		if code == 0 {
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, topic := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
}

// once returns a refuse function for refuseCommits that refuses the first
// commit, and counts the commits asked about in n.
func once(n *atomic.Int64) func() bool { return func() bool { return n.Add(1) == 1 } }

// fenceHeartbeats makes the broker answer the group's heartbeats with
// UNKNOWN_MEMBER_ID while fenced is set: franz-go then reports the
// member's partitions lost.
func fenceHeartbeats(cluster *kfake.Cluster, group string, fenced *atomic.Bool) {
	cluster.ControlKey(kmsg.Heartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		hb := req.(*kmsg.HeartbeatRequest)
		if hb.Group != group || !fenced.Load() {
			return nil, nil, false
		}
		resp := hb.ResponseKind().(*kmsg.HeartbeatResponse)
		resp.ErrorCode = kerr.UnknownMemberID.Code
		return resp, nil, true
	})
}

// failDescribeConfigsOnce makes the broker time out the first
// DescribeConfigs request; failed says it did.
func failDescribeConfigsOnce(cluster *kfake.Cluster) (failed *atomic.Bool) {
	failed = new(atomic.Bool)
	cluster.ControlKey(kmsg.DescribeConfigs.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if !failed.CompareAndSwap(false, true) {
			return nil, nil, false
		}
		dc := req.(*kmsg.DescribeConfigsRequest)
		resp := dc.ResponseKind().(*kmsg.DescribeConfigsResponse)
		for _, r := range dc.Resources {
			rr := kmsg.NewDescribeConfigsResponseResource()
			rr.ResourceType, rr.ResourceName = r.ResourceType, r.ResourceName
			rr.ErrorCode = kerr.RequestTimedOut.Code
			resp.Resources = append(resp.Resources, rr)
		}
		return resp, nil, true
	})
	return failed
}

// end is the end offset of topic's partition 0.
func (w *world) end(t testing.TB, topic string) int64 { return w.ends(t, topic)[0] }

// ends is the end offset of each of topic's partitions.
func (w *world) ends(t testing.TB, topic string) map[int32]int64 {
	t.Helper()
	ends, err := w.admin.ListEndOffsets(context.Background(), topic)
	require.NoError(t, err)
	at := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) { at[o.Partition] = o.Offset })
	return at
}

// It failed when giving up on a record was not stored: R failed its
// attempts and was dead-lettered, S after it was applied, the offset
// commit did not get through before the consumer stopped, R's cause went
// away, and the next consumer applied R, after S. Giving up is stored as
// the ID's final error: the next consumer dead-letters R again and never
// applies it.
func TestGivenUpRecordIsNotAppliedAfterLaterRecords(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	var refuse atomic.Bool
	refuse.Store(true)
	refuseCommits(w.cluster, "order-group", kerr.OffsetMetadataTooLarge.Code, refuse.Load)
	// R credits against a reference that does not exist yet: it fails at
	// COMMIT, the handler's failure, until the reference is there.
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	first := w.startMember(t, "order-group", "payments", idempotencykafka.WithMaxAttempts(2), backoff)
	waitFor(t, "R dead-lettered and S applied", func() bool {
		rows, _ := w.credits(t)
		return rows == 1 && w.end(t, "payments.dead-letter") == 1
	})
	first.stop()
	require.Zero(t, w.committed(t, "order-group", "payments"), "no offset got through")

	refuse.Store(false)
	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	var rOutcomes []idempotency.Outcome
	second := w.startMemberWith(t, memberConfig{store: w.store}, "order-group", "payments", backoff,
		idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
			if header(r, idempotencykafka.DefaultIDHeader) == "r" {
				rOutcomes = append(rOutcomes, o)
			}
		}))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "order-group", "payments") == 2 })
	second.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "R is not applied after S")
	require.Equal(t, []idempotency.Outcome{idempotency.OutcomeReplayed}, rOutcomes, "R's stored give-up is replayed")
	dl := w.readAll(t, "payments.dead-letter", 2)
	require.Contains(t, header(dl[1], idempotencykafka.HeaderCause), "gave up after 2 attempts")
}

// It failed when a dead letter produced back to its topic after the
// handler was fixed was dead-lettered again: the copy kept its ID, whose
// failure was stored, and the fixed handler never ran. Redrive forgets the
// failure and produces the record again under its ID: records with a
// producer's ID and records identified by their position are each applied
// once, and a second redrive of the same dead letters is refused and
// applies nothing.
func TestRedriveAppliesADeadLetterOnceAfterTheFix(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	byPosition := &kgo.Record{Key: []byte("acct-2"), Value: []byte("ref:later")}
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), byPosition, rec("s", "acct-1", "oops"))
	m := w.startMember(t, "redrive-group", "payments", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "three dead letters", func() bool { return w.end(t, "payments.dead-letter") == 3 })
	dls := w.readAll(t, "payments.dead-letter", 3)

	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	ctx := context.Background()
	for _, dl := range dls[:2] {
		require.NoError(t, m.consumer.Redrive(ctx, dl))
	}
	waitFor(t, "the redriven records applied", func() bool {
		rows, _ := w.credits(t)
		return rows == 2 && w.committed(t, "redrive-group", "payments") == 5
	})
	for _, dl := range dls[:2] {
		require.ErrorIs(t, m.consumer.Redrive(ctx, dl), idempotency.ErrNotFailed, "a second redrive is refused")
	}
	// The poison record's cause is not fixed: its redrive dead-letters it
	// again.
	require.NoError(t, m.consumer.Redrive(ctx, dls[2]))
	waitFor(t, "the poison record dead-lettered again", func() bool {
		return w.end(t, "payments.dead-letter") == 4 && w.committed(t, "redrive-group", "payments") == 6
	})
	m.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, rows)
	require.Equal(t, 2, distinct)
	again := w.readAll(t, "payments.dead-letter", 4)[3]
	require.Equal(t, "s", header(again, idempotencykafka.HeaderMessageID), "under its own ID")
	require.Equal(t, "5", header(again, idempotencykafka.HeaderOffset), "at the copy's position")
	require.Error(t, m.consumer.Redrive(ctx, rec("x", "acct-1", "1")), "a record that is not a dead letter")

	// The group's offsets deleted, the topic read again: the originals and
	// the copies are replays, the one identified by its position too.
	_, err = w.admin.DeleteGroups(ctx, "redrive-group")
	require.NoError(t, err)
	reread := w.startMember(t, "redrive-group", "payments")
	waitFor(t, "the topic read again", func() bool { return w.committed(t, "redrive-group", "payments") == 6 })
	reread.stop()
	rows, _ = w.credits(t)
	require.Equal(t, 2, rows, "nothing applied again")
	require.Zero(t, reread.executed.Load())
}

// It failed when the offset committed after a transaction's last record
// stopped at the transaction's commit marker: a transactional partition
// showed a lag of 1 forever. New requires a client that keeps the markers,
// and the consumer commits past them: the committed offset reaches the
// partition's end.
func TestTransactionalPartitionsLagReachesZero(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	hides, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits"), kgo.DisableAutoCommit(),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.BlockRebalanceOnPoll())
	require.NoError(t, err)
	_, err = idempotencykafka.New(w.store, hides, credit)
	hides.Close()
	require.ErrorContains(t, err, "set kgo.KeepControlRecords()")

	ctx := context.Background()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic("credits"), kgo.TransactionalID("lag-producer"))
	require.NoError(t, err)
	defer p.Close()
	for i := range 2 {
		require.NoError(t, p.BeginTransaction())
		require.NoError(t, p.ProduceSync(ctx, amounts(4)[2*i:2*i+2]...).FirstErr())
		require.NoError(t, p.EndTransaction(ctx, kgo.TryCommit))
	}
	end := w.end(t, "credits")
	require.EqualValues(t, 6, end, "4 records and 2 commit markers")
	m := w.startMember(t, "lag-group", "credits")
	waitFor(t, "the committed offset at the end", func() bool { return w.committed(t, "lag-group", "credits") == end })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 4, rows)
}

// The handler says which of its errors are not the record's fault: a
// record whose handler fails with one (here a reference that has not
// arrived yet) is tried past WithMaxAttempts until it succeeds, and
// applied once (without it, TestGivenUpRecordIsNotAppliedAfterLaterRecords
// gives the same record up after two).
func TestRetryableErrorsWaitPastMaxAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	var released atomic.Int64
	m := w.startMember(t, "retryable-group", "payments", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(err error) bool { return strings.Contains(err.Error(), "credits_ref_fkey") }),
		idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
			if o == idempotency.OutcomeReleased {
				released.Add(1)
			}
		}))
	waitFor(t, "five tries", func() bool { return released.Load() >= 5 })
	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "retryable-group", "payments") == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 2, rows)
	require.Zero(t, w.end(t, "payments.dead-letter"), "nothing dead-lettered")

	_, err = idempotencykafka.New(w.store, m.client, credit, idempotencykafka.WithRetryable(nil))
	require.ErrorContains(t, err, "WithRetryable")
}

// commitRequests counts the group's OffsetCommit requests and the most
// partitions one of them carried, letting every request through.
func commitRequests(cluster *kfake.Cluster, group string) (requests, widest *atomic.Int64) {
	requests, widest = new(atomic.Int64), new(atomic.Int64)
	cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group == group {
			requests.Add(1)
			n := int64(0)
			for _, t := range commit.Topics {
				n += int64(len(t.Partitions))
			}
			if n > widest.Load() {
				widest.Store(n)
			}
		}
		return nil, nil, false
	})
	return requests, widest
}

// It failed when Run took whatever the client had buffered in one poll
// (PollFetches: up to the fetch's 50 MB), which a rebalance then waited
// for: 100 records came in one or two polls. WithMaxPollRecords(10) (the
// default is 500) takes at most 10 per poll, each poll ending in a commit.
func TestPollsAreBounded(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	requests, _ := commitRequests(w.cluster, "bounded")
	w.produce(t, "credits", amounts(100)...)
	m := w.startMember(t, "bounded", "credits", idempotencykafka.WithMaxPollRecords(10), idempotencykafka.WithCommitEvery(1000))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "bounded", "credits") == 100 })
	m.stop()
	require.GreaterOrEqual(t, requests.Load(), int64(10), "a commit per poll of at most 10 records")
	_, err := idempotencykafka.New(w.store, m.client, credit, idempotencykafka.WithMaxPollRecords(0))
	require.ErrorContains(t, err, "WithMaxPollRecords")
}

// It failed when each partition committed its poll's last offset in a
// request of its own: 8 partitions, 8 requests per poll. The poll's
// offsets go in one request once every partition is done.
func TestOnePollOneCommit(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 8, "credits")
	requests, widest := commitRequests(w.cluster, "one-commit")
	w.produce(t, "credits", amounts(400)...)
	m := w.startMember(t, "one-commit", "credits", idempotencykafka.WithCommitEvery(1000))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "one-commit", "credits") == 400 })
	m.stop()
	require.Greater(t, widest.Load(), int64(1), "a request carries several partitions (%d requests)", requests.Load())
	rows, _ := w.credits(t)
	require.Equal(t, 400, rows)
}

// Without the callbacks, a partition the member lost (its heartbeat
// refused: fenced) was worked on for as long as its record waited, here
// forever: ProcessFetches never returned. With kgo.BlockRebalanceOnPoll,
// franz-go reports the loss only once the poll allows it; with
// kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked)
// the poll is told that a rebalance waits for it: the record stops
// waiting, no offset is committed, ProcessFetches returns saying so, and
// once the poll allows the rebalance the loss is reported.
func TestLostPartitionsWorkStops(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	var fenced atomic.Bool
	fenceHeartbeats(w.cluster, "lost-group", &fenced)
	w.produce(t, "payments", rec("r", "acct-1", "ref:never"))
	var lost atomic.Bool
	client, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("lost-group"), kgo.ConsumeTopics("payments"),
		kgo.DisableAutoCommit(), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.HeartbeatInterval(100*time.Millisecond),
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked),
		kgo.OnPartitionsLost(func(ctx context.Context, cl *kgo.Client, ps map[string][]int32) {
			idempotencykafka.OnPartitionsLost(ctx, cl, ps)
			lost.Store(true)
		}))
	require.NoError(t, err)
	defer client.Close()
	var tries atomic.Int64
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(error) bool { return true }),
		idempotencykafka.WithOutcomeHandler(func(*kgo.Record, idempotency.Outcome, error) { tries.Add(1) }))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fetches := pollRecords(t, client, 1)
	done := make(chan error, 1)
	go func() { done <- c.ProcessFetches(ctx, fetches) }()
	waitFor(t, "the record tried", func() bool { return tries.Load() >= 3 })
	fenced.Store(true)
	select {
	case err := <-done:
		require.ErrorContains(t, err, "a rebalance waits for the poll")
	case <-time.After(time.Minute):
		t.Fatal("ProcessFetches still works on the lost partition")
	}
	require.False(t, lost.Load(), "the loss waited for the poll")
	client.AllowRebalance()
	waitFor(t, "the loss reported once the poll allowed it", lost.Load)
	require.Zero(t, w.committed(t, "lost-group", "payments"))
}

// A poll's offsets go in one commit, but a partition done does not wait
// for a slow one for long: while partition 0's record waits for its
// reference (a retryable error), partition 1's records are applied and
// their offsets committed; partition 0's follows once it is done.
func TestDonePartitionsAreCommittedWhileAnotherWaits(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 2, "payments")
	// The round-robin producer puts the records on partitions 0, 1, 0, 1.
	w.produce(t, "payments", rec("slow", "acct-1", "ref:later"), rec("a", "acct-1", "1"), rec("b", "acct-1", "2"), rec("c", "acct-1", "3"))
	m := w.startMember(t, "flush-group", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(error) bool { return true }))
	partition := func(p int32) int64 {
		offsets, err := w.admin.FetchOffsets(context.Background(), "flush-group")
		if err != nil {
			return 0
		}
		o, _ := offsets.Lookup("payments", p)
		return o.At
	}
	waitFor(t, "partition 1 committed", func() bool { return partition(1) == 2 })
	require.Less(t, partition(0), int64(1), "partition 0's record still waits")
	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	waitFor(t, "partition 0 committed", func() bool { return partition(0) == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 4, rows)
}

// A handler's error can be megabytes long; a dead letter's headers and a
// given-up ID's stored error cannot: both are cut to a few KiB, and the
// record's dead letter is produced whole (with its value) all the same.
func TestLongHandlerErrorsAreCutInDeadLetters(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("long", "acct-1", "fail: "+strings.Repeat("é", 300_000)))
	m := w.startMember(t, "long-group", "payments", idempotencykafka.WithMaxAttempts(1))
	waitFor(t, "the offset committed", func() bool { return w.committed(t, "long-group", "payments") == 1 })
	m.stop()
	dl := w.readAll(t, "payments.dead-letter", 1)[0]
	require.NotEmpty(t, dl.Value, "the dead letter keeps the value")
	cause := header(dl, idempotencykafka.HeaderCause)
	require.LessOrEqual(t, len(cause), 8<<10)
	require.True(t, utf8.ValidString(cause), "cut on a character boundary")
	rec, err := w.store.Inspect(context.Background(), "kafka/long-group/payments", "message long")
	require.NoError(t, err)
	require.LessOrEqual(t, len(rec.Status.Message()), 8<<10, "the stored give-up is cut too")
}

// A DescribeConfigs that fails once, for a reason that may pass (a
// timeout), does not stop Run without WithTTL (as it did), nor lets it go
// on with a TTL it did not read: Run reads the configs again, and the
// records' IDs are kept for the topic's retention and the offsets'.
func TestRunReadsTheConfigsAgainAfterATransientFailure(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	failed := failDescribeConfigsOnce(w.cluster)
	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "configs-again", "credits", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "configs-again", "credits") == 3 })
	m.stop()
	require.True(t, failed.Load())
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`))
}

// A topic's dead letters are its records: read back from a dead-letter
// topic that keeps them 30 days, they must find their IDs, so the IDs of
// the topic's records outlast the dead-letter topic's retention too.
func TestIDsOutlastTheDeadLetterTopicsRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	ms := "2592000000"
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, "payments.dead-letter")
	require.NoError(t, err)
	w.produce(t, "payments", amounts(3)...)
	m := w.startMember(t, "dlt-retention", "payments")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "dlt-retention", "payments") == 3 })
	m.stop()
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`))
}
