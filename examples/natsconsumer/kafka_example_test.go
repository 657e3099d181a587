package natsconsumer_test

import (
	"context"
	"fmt"
	"log"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

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

// A Kafka consumer follows the same two rules as the NATS one: the record's
// effect commits together with its ID, and the offset is committed only
// after that.
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

	// handle is called for each polled record; commit is the client's offset
	// commit for that record.
	handle := func(ctx context.Context, rec kafkaRecord, commit func(context.Context, kafkaRecord) error) error {
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
		switch {
		case err != nil && !idempotency.IsFinal(err):
			// Nothing committed (or another consumer holds the ID during a
			// rebalance): leave the offset, seek back to rec and retry.
			return err
		case outcome == idempotency.OutcomeReplayed:
			log.Printf("%s: already applied, committing its offset", id)
		}
		// Applied now or before, or a final poison outcome: done.
		return commit(ctx, rec)
	}
	_ = handle
}
