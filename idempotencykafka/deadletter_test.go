package idempotencykafka_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Records that can never succeed go to the dead-letter topic with their
// cause, and the partition moves on: a poison record (a final error), an
// ID reused for another record, and, after their attempts, a record whose
// deferred foreign key finds no referenced row at any commit (a row that
// may still arrive, so each attempt is the handler's failure, nothing
// stored, as with an immediate foreign key) and a handler that fails every
// time.
func TestRecordsThatCanNeverSucceedAreDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments",
		rec("m-1", "acct-1", "100"),
		rec("m-2", "acct-1", "oops"),
		rec("m-1", "acct-1", "999"),
		rec("m-3", "acct-1", "ref:missing"),
		rec("m-4", "acct-1", "fail"),
		rec("m-5", "acct-1", "ref:known"),
		rec("m-6", "acct-2", "200"),
	)
	var deadLettered atomic.Int64
	m := w.startMember(t, "dl-group", "payments", idempotencykafka.WithMaxAttempts(3), idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(*kgo.Record, string) { deadLettered.Add(1) }))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "dl-group", "payments") == 7 })
	m.stop()

	var ids []string
	rows, err := w.db.Pool.Query(context.Background(), `SELECT msg_id FROM credits ORDER BY id`)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"m-1", "m-5", "m-6"}, ids, "the good records' effects, once each")
	require.EqualValues(t, 4, deadLettered.Load())

	dl := w.readAll(t, "payments.dead-letter", 4)
	type letter struct{ offset, id, outcome, cause string }
	var got []letter
	for _, r := range dl {
		got = append(got, letter{header(r, idempotencykafka.HeaderOffset), header(r, idempotencykafka.HeaderMessageID), header(r, idempotencykafka.HeaderOutcome), header(r, idempotencykafka.HeaderCause)})
		require.Equal(t, "payments", header(r, idempotencykafka.HeaderTopic))
		require.Equal(t, header(r, idempotencykafka.DefaultIDHeader), header(r, idempotencykafka.HeaderMessageID), "the original headers are kept")
	}
	require.Len(t, got, 4)
	for i, want := range []struct{ offset, id, outcome, cause string }{
		{"1", "m-2", "executed", "is not an amount"},
		{"2", "m-1", "key_reused", "different request"},
		{"3", "m-3", "released", "gave up after 3 attempts: idempotency: the call's writes violate constraint credits_ref_fkey"},
		{"4", "m-4", "released", "gave up after 3 attempts: the ledger refuses this record today"},
	} {
		require.Equal(t, want.offset, got[i].offset, "dead letter %d", i)
		require.Equal(t, want.id, got[i].id, "dead letter %d", i)
		require.Equal(t, want.outcome, got[i].outcome, "dead letter %d", i)
		require.Contains(t, got[i].cause, want.cause, "dead letter %d", i)
	}
}

// A handler that panics on a record every time does not crash the
// consumer: the record's transaction rolls back, and after its attempts it
// is dead-lettered with the panic as its cause.
func TestHandlerPanicIsDeadLetteredAfterItsAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	w.produce(t, "credits", rec("m-1", "acct-1", "panic"), rec("m-2", "acct-1", "7"))
	var causes []string
	var mu sync.Mutex
	m := w.startMember(t, "panic-group", "credits", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(_ *kgo.Record, cause string) {
			mu.Lock()
			defer mu.Unlock()
			causes = append(causes, cause)
		}))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "panic-group", "credits") == 2 })
	m.stop()
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"gave up after 2 attempts: the handler panicked: the handler cannot read panic"}, causes)
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "m-2 applied; m-1's writes rolled back")
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

// A consumer subscribed to its own dead-letter topic (a regex such as
// ^payments, which TestDeadLettersAreNotDeadLetteredAgain supports) gives
// up on R (its reference is missing), stores the giving up and
// dead-letters it; S behind it is applied. The reference then arrives.
//
// Before the fix: the dead letter, read back from payments.dead-letter,
// is applied like any record, under the scope of the dead-letter topic
// where R's ID is unknown: R's effect commits after S's, which the stored
// giving up was there to prevent; and an operator's Redrive of the dead
// letter (the documented way to apply it once) applies R a second time.
//
// Now: a dead letter read back is never applied (it is left
// where it is, as it is when it fails); R is applied once, by the Redrive.
func TestDeadLetterReadBackIsNeverApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	var fixed atomic.Bool
	m := w.startCustom(t, w.store, "regex-apply", "^payments.*", credit, []kgo.Opt{kgo.ConsumeRegex()},
		idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(r *kgo.Record, _ string) {
			// The cause is fixed once R is dead-lettered (before the dead
			// letter can be polled).
			if r.Topic == "payments" && fixed.CompareAndSwap(false, true) {
				_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
				require.NoError(t, err)
			}
		}))
	waitFor(t, "the records and the dead letter committed", func() bool {
		return w.committed(t, "regex-apply", "payments") == 2 && w.committed(t, "regex-apply", "payments.dead-letter") == 1
	})
	rRows := w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'r'`)
	assert.Zero(t, rRows, "R, given up, is not applied after S by its dead letter read back")

	dl := w.readAll(t, "payments.dead-letter", 1)[0]
	require.NoError(t, m.consumer.Redrive(context.Background(), dl))
	waitFor(t, "the redriven copy committed", func() bool { return w.committed(t, "regex-apply", "payments") == 3 })
	m.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'r'`), "R applied once")
}

// Two groups consume payments by the regex ^payments.*, which matches the
// dead-letter topic too (the case the package supports: a consumer
// subscribed to its own dead-letter topic). By default both groups'
// dead-letter topic is payments.dead-letter. Group A cannot apply R (a
// final error of its own handler) and dead-letters it; group B applies R.
//
// Before the fix: B reads A's dead letter of R back from payments.dead-letter. Its
// scope header is A's, so B does not take it for a dead letter of its own
// and applies it as a record of the topic payments.dead-letter, under a
// scope where R's ID is unknown: B applies R's effect twice.
//
// Now: each group applies each record once; B never applies a dead
// letter (of any group) as a new record.
func TestAnotherGroupsDeadLetterIsNotAppliedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.createApplied(t)
	w.produce(t, "payments", rec("r", "acct-1", "100"))
	regex := []kgo.Opt{kgo.ConsumeRegex()}
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	a := w.startCustom(t, w.store, "group-a", "^payments.*", applyAs("a", func() bool { return true }), regex, backoff)
	waitFor(t, "A dead-letters R", func() bool { return w.end(t, "payments.dead-letter") == 1 })
	b := w.startCustom(t, w.store, "group-b", "^payments.*", applyAs("b", nil), regex, backoff)
	waitFor(t, "B read both topics", func() bool {
		return w.committed(t, "group-b", "payments") == 1 && w.committed(t, "group-b", "payments.dead-letter") == 1
	})
	a.stop()
	b.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b' AND msg_id = 'r'`), "group B applies R once")
}

// poisonNeverBlocks produces a poison record and a good one to topic, and
// requires that New refuses the consumer (naming the dead-letter topic),
// or that the poison record does not stop its partition: both offsets are
// committed within 30 seconds (it takes well under one when the dead
// letter can be produced).
func poisonNeverBlocks(t *testing.T, w *world, topic string, opts ...idempotencykafka.Option) {
	t.Helper()
	w.produce(t, topic, rec("poison", "acct-1", "oops"), rec("good", "acct-1", "100"))
	client, err := kgo.NewClient(consumerOpts(w.brokers, "dlt-group", topic)...)
	require.NoError(t, err)
	defer client.Close()
	if _, err := idempotencykafka.New(w.store, client, credit, opts...); err != nil {
		require.ErrorContains(t, err, "WithDeadLetterTopic", "refused for its dead-letter topic")
		return
	}
	m := runCustom(t, w.store, client, credit, append(opts, idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))...)
	waitFor(t, "the poison record does not block its partition", func() bool { return w.committed(t, "dlt-group", topic) == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "the good record behind it is applied")
}

// It failed when a topic with a name of 245 characters (Kafka allows 249)
// had the default dead-letter topic of its name followed by
// ".dead-letter", 257 characters, a name no broker accepts and no operator
// can create: the dead letter was refused forever and the record behind
// it never applied. The default cuts such a name short and adds a hash of
// it; once that topic exists, the poison record is dead-lettered there and
// the partition goes on.
func TestDeadLetterTopicNameTooLongNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	topic := strings.Repeat("t", 245)
	dlt := idempotencykafka.DefaultDeadLetterTopic(topic)
	require.Len(t, dlt, 249)
	require.NotEqual(t, dlt, idempotencykafka.DefaultDeadLetterTopic(strings.Repeat("t", 244)+"u"), "two long topics never share one")
	w := newWorld(t, 1, topic, dlt)
	poisonNeverBlocks(t, w, topic)
	require.Len(t, w.readAll(t, dlt, 1), 1)
}

// WithDeadLetterTopic's function returns "" (for some topics, say).
//
// Before the fix: New accepts it; the dead letter fails in the client
// ("cannot produce record with no topic and no default topic"), an error
// no retry fixes, which is retried forever: the partition never moves.
//
// Now: New refuses an empty dead-letter topic for the
// topics it knows, and a produce the client itself refuses for good is
// given up like one the broker refuses for good.
func TestEmptyDeadLetterTopicNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	poisonNeverBlocks(t, w, "payments", idempotencykafka.WithDeadLetterTopic(func(string) string { return "" }))
}

// A dead-letter topic that can never exist, for a topic New did not know
// (matched by a regex): the poison record is given up without a dead
// letter, reported, and the partition goes on.
func TestInvalidDeadLetterTopicOfATopicMetLaterIsGivenUp(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "late-payments")
	w.produce(t, "late-payments", rec("poison", "acct-1", "oops"), rec("good", "acct-1", "100"))
	var reported atomic.Int64
	m := w.startCustom(t, w.store, "late-group", "^late", credit, []kgo.Opt{kgo.ConsumeRegex()},
		idempotencykafka.WithDeadLetterTopic(func(topic string) string { return topic + "/dead" }),
		idempotencykafka.WithErrorHandler(func(err error) {
			if strings.Contains(err.Error(), "is not a valid topic name") {
				reported.Add(1)
			}
		}))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "late-group", "late-payments") == 2 })
	m.stop()
	require.EqualValues(t, 1, reported.Load())
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}

// A record of payments carries the headers of a dead letter naming a topic
// that does not exist: a producer's forwarded or forged headers, or, for a
// group that reads a dead-letter topic, the dead letter of a topic deleted
// since. Behind it in the partition is a good record.
//
// Before the fix: the record is identified as a record of the named topic, whose
// retention is read for its ID's TTL; DescribeConfigs answers
// UNKNOWN_TOPIC_OR_PARTITION, taken for a failure that may pass, and the
// record waits for it, tried again forever: neither it nor the good record
// behind it is ever applied or committed (one record's headers stop the
// partition).
//
// Now: a record whose named original topic does not exist never blocks
// its partition: it is applied (as itself), dead-lettered, or skipped
// with an error, and the good record behind it is applied: both offsets
// are committed.
func TestDeadLetterHeadersNamingATopicThatDoesNotExistNeverBlockThePartition(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", forgedDeadLetter("5", "no-such-topic", "0", "0"), rec("good", "acct-1", "7"))
	var waits atomic.Value
	m := w.startMember(t, "unknown-origin", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 50*time.Millisecond),
		idempotencykafka.WithErrorHandler(func(err error) {
			if strings.Contains(err.Error(), "waits") {
				waits.CompareAndSwap(nil, err.Error())
			}
		}))
	defer func() { t.Logf("the consumer said: %v", waits.Load()) }()
	waitFor(t, "the record naming a missing topic does not block its partition", func() bool { return w.committed(t, "unknown-origin", "payments") == 2 })
	m.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'good'`), "the good record behind it is applied")
}

// forgedDeadLetter is a producer's record that carries the headers of a
// dead letter (forwarded from elsewhere, or forged) naming the position
// topic/partition/offset.
func forgedDeadLetter(value, topic, partition, offset string) *kgo.Record {
	return &kgo.Record{Key: []byte("acct-1"), Value: []byte(value), Headers: []kgo.RecordHeader{
		{Key: idempotencykafka.HeaderCause, Value: []byte("forwarded")},
		{Key: idempotencykafka.HeaderTopic, Value: []byte(topic)},
		{Key: idempotencykafka.HeaderPartition, Value: []byte(partition)},
		{Key: idempotencykafka.HeaderOffset, Value: []byte(offset)},
	}}
}

// A group identifies records by position (they carry no ID header of its
// own). A producer's record X at payments/0/0 carries the headers of a dead
// letter naming payments/0/1: a position no dead letter can name, since a
// record's dead letter is produced after it, to another topic. Y, a record
// of its own, is then produced at payments/0/1. (The redriven-from header
// was fixed for this case, TestForgedRedrivenFromNeverTakesAnotherRecordsID;
// the dead-letter headers take the same path to another record's ID.)
//
// Before the fix: X is taken for the record at payments/0/1 and applied under that
// ID; Y, under its own position, finds that ID taken by another body and
// is dead-lettered as key_reused: a record no one dead-lettered is never
// applied (and Redrive refuses its dead letter, key_reused).
//
// Now: dead-letter headers that cannot be a dead letter's (naming the
// record's own topic at a position not before it) are not an ID: X and Y
// are applied once each, nothing dead-lettered.
func TestForgedDeadLetterHeadersNeverTakeALaterRecordsID(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", forgedDeadLetter("5", "payments", "0", "1"))
	w.produce(t, "payments", &kgo.Record{Key: []byte("acct-1"), Value: []byte("7")})
	m := w.startMember(t, "forged-dl", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "forged-dl", "payments") == 2 })
	m.stop()
	require.Zero(t, w.end(t, "payments.dead-letter"), "nothing dead-lettered")
	require.Equal(t, 12, w.db.Count(t, `SELECT coalesce(sum(cents), 0) FROM credits`), "X's 5 cents and Y's 7")
}
