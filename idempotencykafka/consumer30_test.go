package idempotencykafka_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// It failed when New took a client with franz-go's default isolation
// level, which reads the records of aborted transactions: a transactional
// producer's aborted send and its committed re-send were both applied. New
// now refuses such a client, and a consumer that reads committed records
// applies the re-send alone.
func TestAbortedTransactionsAreNeverApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	uncommitted, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits"), kgo.DisableAutoCommit())
	require.NoError(t, err)
	_, err = idempotencykafka.New(w.store, uncommitted, credit)
	uncommitted.Close()
	require.ErrorContains(t, err, "set kgo.FetchIsolationLevel(kgo.ReadCommitted())")

	ctx := context.Background()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic("credits"), kgo.TransactionalID("credits-producer"))
	require.NoError(t, err)
	defer p.Close()
	for _, end := range []kgo.TransactionEndTry{kgo.TryAbort, kgo.TryCommit} {
		require.NoError(t, p.BeginTransaction())
		require.NoError(t, p.ProduceSync(ctx, rec("pay-1", "acct-1", "100")).FirstErr())
		require.NoError(t, p.EndTransaction(ctx, end))
	}
	var offsets []int64
	applied := make(chan struct{})
	m := w.startMember(t, "tx-group", "credits", idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
		offsets = append(offsets, r.Offset)
		if o == idempotency.OutcomeExecuted {
			close(applied)
		}
	}))
	select {
	case <-applied:
	case <-time.After(30 * time.Second):
		t.Fatal("the committed record was not applied")
	}
	m.stop()
	require.Len(t, offsets, 1, "only the committed record was delivered: offsets %v", offsets)
	rows, distinct := w.credits(t)
	require.Equal(t, 1, rows)
	require.Equal(t, 1, distinct)
}

// It failed when a producer's message-id that is not a valid key (a space,
// "é", a NUL, 256 bytes) dead-lettered a good record unapplied, and an
// empty one was taken as an ID. Such IDs are recorded hashed, an empty one
// is no ID (the record's position identifies it), and each record is
// applied once; a redelivery of each replays.
func TestInvalidProducerIDsAreHashedAndApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	ids := []string{"order 1", "ordér-2", "order\x013", strings.Repeat("o", 256), ""}
	var records []*kgo.Record
	for _, id := range ids {
		records = append(records, rec(id, "acct-1", "100"))
	}
	w.produce(t, "credits", records...)
	m := w.startMember(t, "ids-group", "credits", idempotencykafka.WithDeadLetterHandler(func(r *kgo.Record, cause string) {
		t.Errorf("record %d dead-lettered: %s", r.Offset, cause)
	}))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ids-group", "credits") == int64(len(ids)) })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, len(ids), rows, "each record applied once")
	require.EqualValues(t, len(ids), m.executed.Load())

	// Delivered again from the start, under the same scope: all replayed.
	again := w.startMember(t, "ids-group-2", "credits", idempotencykafka.WithScope("kafka/ids-group/credits"))
	waitFor(t, "every offset committed again", func() bool { return w.committed(t, "ids-group-2", "credits") == int64(len(ids)) })
	again.stop()
	rows, _ = w.credits(t)
	require.Equal(t, len(ids), rows, "no record applied twice")
	require.EqualValues(t, len(ids), again.replayed.Load())
}

// It failed when producer IDs and positions shared one namespace: a record
// whose message-id is "credits/0/0" (the position of another record) with
// the same key and value was skipped as that record's replay, and with
// another value dead-lettered as a reused key. Producer IDs that read as
// positions are recorded hashed.
func TestProducerIDsAndPositionsNeverMeet(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	bare := &kgo.Record{Key: []byte("acct-1"), Value: []byte("100")} // at credits/0/0
	w.produce(t, "credits", bare, rec("credits/0/0", "acct-1", "100"), rec("credits/0/0", "acct-1", "250"), rec("position-00", "acct-1", "7"))
	m := w.startMember(t, "ns-group", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ns-group", "credits") == 4 })
	m.stop()
	var cents []int64
	r, err := w.db.Pool.Query(context.Background(), `SELECT cents FROM credits ORDER BY id`)
	require.NoError(t, err)
	cents, err = pgx.CollectRows(r, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, []int64{100, 100, 7}, cents, "the bare record, the producer's credits/0/0 once (its second body is a reused ID), position-00")
}

// It failed when New accepted a scope the store refuses (over 1,024
// bytes): every record then failed, retried forever.
func TestNewRefusesAScopeTheStoreCannotKeep(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	client, err := kgo.NewClient(consumerOpts(w.brokers, "g", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	_, err = idempotencykafka.New(w.store, client, credit, idempotencykafka.WithScope(strings.Repeat("s", idempotency.MaxScopeLen+1)))
	require.ErrorContains(t, err, "WithScope")
	require.ErrorContains(t, err, "the limit is 1024")
}

// It failed when the ID's lifetime defaulted to the engine's 24 hours
// while Kafka keeps records and an idle group's offsets 7 days each: 10
// records consumed, their keys two days old, the group's offsets deleted,
// and the group read the topic again: 20 effects. Run now derives the TTL
// from the topic's retention.ms and the brokers' offsets.retention.minutes
// (here 7 days each), so the keys outlast both: 10 effects, 10 replays.
func TestDefaultTTLOutlastsRetentionAndOffsets(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(10)...)
	m := w.startMember(t, "ttl-group", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ttl-group", "credits") == 10 })
	m.stop()
	ctx := context.Background()
	require.Equal(t, 10, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`), "the keys outlast retention and offsets")
	_, err := w.db.Pool.Exec(ctx, `UPDATE idempotency_keys SET created_at = created_at - interval '2 days', expires_at = expires_at - interval '2 days'`)
	require.NoError(t, err)
	_, err = w.admin.DeleteGroups(ctx, "ttl-group")
	require.NoError(t, err)

	again := w.startMember(t, "ttl-group", "credits")
	waitFor(t, "every offset committed again", func() bool { return w.committed(t, "ttl-group", "credits") == 10 && again.replayed.Load() == 10 })
	again.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 10, rows, "each record applied once")
}

// An explicit TTL shorter than retention plus the offsets' retention is
// refused by Run, naming both; a topic that keeps its records forever
// needs an explicit TTL, and runs with one.
func TestTTLShorterThanRetentionIsRefused(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "forever")
	ctx := context.Background()
	forever := "-1"
	_, err := w.admin.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "retention.ms", Value: &forever}}, "forever")
	require.NoError(t, err)
	run := func(topic string, opts ...idempotencykafka.Option) error {
		client, err := kgo.NewClient(consumerOpts(w.brokers, "g-"+topic, topic)...)
		require.NoError(t, err)
		defer client.Close()
		c, err := idempotencykafka.New(w.store, client, credit, opts...)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return c.Run(ctx)
	}
	err = run("credits", idempotencykafka.WithTTL(time.Hour))
	require.ErrorContains(t, err, "WithTTL(1h0m0s) is shorter than topic credits's retention.ms (168h0m0s) and segment.ms (168h0m0s) plus the brokers' offsets.retention.minutes (168h0m0s)")
	require.ErrorContains(t, err, "set at least 504h0m0s")
	require.ErrorIs(t, run("credits", idempotencykafka.WithTTL(22*24*time.Hour)), context.DeadlineExceeded, "a long enough TTL runs")
	require.ErrorContains(t, run("forever"), "keeps its records forever")
	require.ErrorIs(t, run("forever", idempotencykafka.WithTTL(30*24*time.Hour)), context.DeadlineExceeded, "an explicit TTL is the operator's decision")
}

// It failed when every produce error of a dead letter was retried: a
// poison record near the size limit, whose dead-letter copy (its value,
// its headers and six more, one a cause quoting the value) is too large,
// got MESSAGE_TOO_LARGE forever and nothing after it was applied. A dead
// letter the broker refuses for good falls back to one that fits (key, no
// value, the cause cut short, the original's position), and the partition
// goes on.
func TestTooLargeDeadLetterFallsBackToOneThatFits(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("big", "acct-1", strings.Repeat("x", 1000012-200)), rec("next", "acct-1", "100"))
	m := w.startMember(t, "big-group", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "big-group", "payments") == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "the record after the poison one is applied")
	dl := w.readAll(t, "payments.dead-letter", 1)
	require.Empty(t, dl[0].Value, "the dead letter that fits has no value")
	require.Contains(t, header(dl[0], idempotencykafka.HeaderValueOmitted), "MESSAGE_TOO_LARGE")
	require.Equal(t, "0", header(dl[0], idempotencykafka.HeaderOffset), "it points at the original")
	require.Equal(t, "payments", header(dl[0], idempotencykafka.HeaderTopic))
	require.LessOrEqual(t, len(header(dl[0], idempotencykafka.HeaderCause)), 1<<10+len("... (cut)"), "the cause is cut short")
}

// It failed when a consumer subscribed to its own dead-letter topic (a
// regex like ^payments) dead-lettered dead letters forever:
// payments.dead-letter.dead-letter and on. A record that carries the
// dead-letter headers is not dead-lettered again; it is committed where it
// is.
func TestDeadLettersAreNotDeadLetteredAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter", "payments.dead-letter.dead-letter")
	w.produce(t, "payments", rec("m-1", "acct-1", "oops"))
	m := w.startMemberWith(t, memberConfig{store: w.store, client: []kgo.Opt{kgo.ConsumeRegex()}}, "regex-group", "^payments.*")
	waitFor(t, "the poison record and its dead letter committed", func() bool {
		return w.committed(t, "regex-group", "payments") == 1 && w.committed(t, "regex-group", "payments.dead-letter") == 1
	})
	m.stop()
	ends, err := w.admin.ListEndOffsets(context.Background(), "payments.dead-letter.dead-letter")
	require.NoError(t, err)
	end, _ := ends.Lookup("payments.dead-letter.dead-letter", 0)
	require.Zero(t, end.Offset, "no dead letter of a dead letter")
}

// It failed when errors were classified by status code alone: a handler's
// own Aborted or ResourceExhausted (a downstream gRPC call's) was taken for
// the database's trouble and retried forever, past WithMaxAttempts(3). The
// database's trouble is what the engine found; the handler's own codes
// count against the record.
func TestHandlersOwnAbortedIsBoundedByMaxAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("m-1", "acct-1", "downstream-aborted"), rec("m-2", "acct-1", "downstream-exhausted"), rec("m-3", "acct-1", "100"))
	m := w.startMember(t, "own-codes", "payments", idempotencykafka.WithMaxAttempts(3), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "own-codes", "payments") == 3 })
	m.stop()
	dl := w.readAll(t, "payments.dead-letter", 2)
	for _, r := range dl {
		require.Contains(t, header(r, idempotencykafka.HeaderCause), "gave up after 3 attempts")
	}
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}

// It failed when a failed offset commit was reported and never tried
// again: one OffsetCommit refused by the broker left the committed offset
// at 0 with 3 records applied, and the lag never cleared. A commit is tried
// again, with backoff, until it succeeds.
func TestFailedOffsetCommitIsTriedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	var asked atomic.Int64
	refuseCommits(w.cluster, "commit-group", kerr.OffsetMetadataTooLarge.Code, once(&asked))
	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "commit-group", "credits", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "the offsets committed after the refusal", func() bool { return w.committed(t, "commit-group", "credits") == 3 })
	m.stop()
	require.Greater(t, asked.Load(), int64(1), "the refused commit was tried again")
	rows, _ := w.credits(t)
	require.Equal(t, 3, rows)
}
