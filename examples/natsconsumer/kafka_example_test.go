package natsconsumer_test

import (
	"context"
	"fmt"
	"log"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// kafkaRecord stands in for a Kafka client's record (kgo.Record in franz-go,
// kafka.Message in kafka-go), so that this module needs no Kafka client.
type kafkaRecord struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte // the account
	Value     []byte // the amount in cents
	Headers   map[string]string
}

// kafkaClient is what handleRecord needs of a Kafka client: commit a
// record's offset, and produce a record to the dead-letter topic.
type kafkaClient interface {
	Commit(ctx context.Context, rec kafkaRecord) error
	DeadLetter(ctx context.Context, rec kafkaRecord, cause error) error
}

// handleRecord applies one polled record at most once. A non-nil error
// means: leave the offset, seek back to rec and poll it again later.
func handleRecord(ctx context.Context, store *idempotency.Store, client kafkaClient, rec kafkaRecord) error {
	// A producer-set ID also catches a record that was produced twice;
	// the record's position only catches a redelivery of the same record.
	id := rec.Headers["message-id"]
	if id == "" {
		id = fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset)
	}
	outcome, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "credits-group", ID: id, Body: rec.Value},
		func(ctx context.Context, tx pgx.Tx) error {
			amount, err := strconv.ParseInt(string(rec.Value), 10, 64)
			if err != nil {
				return idempotency.Final(err) // poison: stored as final, never retried
			}
			_, err = tx.Exec(ctx, `INSERT INTO account_credits (msg_id, account_id, amount_cents) VALUES ($1, $2, $3)`,
				id, string(rec.Key), amount)
			return err
		})
	switch idempotency.DispositionOf(outcome, err) {
	case idempotency.Redeliver:
		// Nothing committed (or another consumer holds the ID during a
		// rebalance): leave the offset, seek back to rec and retry.
		return err
	case idempotency.DeadLetter:
		// It can never be applied (poison, a reused ID, an invalid one):
		// park it where an operator sees it, then move on.
		if err := client.DeadLetter(ctx, rec, err); err != nil {
			return err
		}
	}
	// Applied now or before, or dead-lettered: done.
	return client.Commit(ctx, rec)
}

// A Kafka consumer follows the same rules as the NATS one: the record's
// effect commits together with its ID, the offset is committed only after
// that, and a record that can never be applied is dead-lettered, not
// redelivered forever.
func Example_kafka() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	var client kafkaClient // your Kafka client, e.g. franz-go's
	var records []kafkaRecord
	for _, rec := range records { // your poll loop
		if err := handleRecord(ctx, store, client, rec); err != nil {
			log.Printf("seek back to %s/%d/%d: %v", rec.Topic, rec.Partition, rec.Offset, err)
		}
	}
}

// fakeKafka records what handleRecord did with each record.
type fakeKafka struct {
	committed, deadLettered []int64
}

func (k *fakeKafka) Commit(_ context.Context, rec kafkaRecord) error {
	k.committed = append(k.committed, rec.Offset)
	return nil
}

func (k *fakeKafka) DeadLetter(_ context.Context, rec kafkaRecord, _ error) error {
	k.deadLettered = append(k.deadLettered, rec.Offset)
	return nil
}

// A partition with a record whose ID was first used with another body, and
// a poison record: the poll loop seeks back on every error, and still moves
// past both, each dead-lettered once; the good records are applied once.
func TestKafkaPartitionNeverStallsOnAPermanentFailure(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	ctx := context.Background()
	rec := func(offset int64, id, value string) kafkaRecord {
		return kafkaRecord{Topic: "credits", Offset: offset, Key: []byte("acct-1"), Value: []byte(value), Headers: map[string]string{"message-id": id}}
	}
	partition := []kafkaRecord{
		rec(0, "m-1", "100"),
		rec(1, "m-1", "999"), // the same ID, another body
		rec(2, "m-2", "ten"), // poison
		rec(3, "m-1", "100"), // a duplicate of the first
		rec(4, "m-3", "50"),
	}
	k := &fakeKafka{}
	polls := 0
	for next := 0; next < len(partition); polls++ {
		require.Less(t, polls, 20, "the partition is stuck at offset %d", next)
		if err := handleRecord(ctx, store, k, partition[next]); err != nil {
			continue // seek back: poll the same record again
		}
		next++
	}
	require.Equal(t, []int64{0, 1, 2, 3, 4}, k.committed)
	require.Equal(t, []int64{1, 2}, k.deadLettered)
	require.Equal(t, len(partition), polls, "no record was polled twice")
	var total int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(amount_cents) FROM account_credits`).Scan(&total))
	require.EqualValues(t, 150, total)
}
