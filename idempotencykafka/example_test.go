package idempotencykafka_test

import (
	"context"
	"fmt"
	"log"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A record produced twice is applied once; a poison record goes to the
// dead-letter topic, and the partition moves on. (The broker is kfake,
// franz-go's in-process Kafka; the database is the test database.)
func ExampleConsumer() {
	ctx := context.Background()
	cluster, err := kfake.NewCluster(kfake.SeedTopics(1, "payments", "payments.dead-letter"))
	if err != nil {
		log.Fatal(err)
	}
	defer cluster.Close()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE credits (account text NOT NULL, cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	producer, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.DefaultProduceTopic("payments"))
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	for _, r := range []*kgo.Record{rec("m-1", "acct-1", "100"), rec("m-1", "acct-1", "100"), rec("m-2", "acct-1", "oops")} {
		if err := producer.ProduceSync(ctx, r).FirstErr(); err != nil {
			log.Fatal(err)
		}
	}

	client, err := kgo.NewClient(
		kgo.SeedBrokers(cluster.ListenAddrs()...),
		kgo.ConsumerGroup("credits"),
		kgo.ConsumeTopics("payments"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),                                                       // required: offsets follow the database
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),                                  // required: no record of an aborted transaction
		kgo.KeepControlRecords(),                                                      // required: offsets committed past transaction markers
		kgo.BlockRebalanceOnPoll(),                                                    // required: no partition revoked mid-poll
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked), // recommended: a rebalance never waits for retries
	)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	ctx, stop := context.WithCancel(ctx)
	c, err := idempotencykafka.New(store, client, func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		cents, err := strconv.ParseInt(string(r.Value), 10, 64)
		if err != nil {
			return idempotency.Final(fmt.Errorf("%q is not an amount", r.Value)) // poison: never retried
		}
		_, err = tx.Exec(ctx, `INSERT INTO credits (account, cents) VALUES ($1, $2)`, string(r.Key), cents)
		return err
	},
		idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
			fmt.Printf("offset %d (%s): %s\n", r.Offset, header(r, "message-id"), o)
		}),
		idempotencykafka.WithDeadLetterHandler(func(r *kgo.Record, cause string) {
			fmt.Printf("offset %d dead-lettered: %s\n", r.Offset, cause)
			stop() // the last record: end the example
		}))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(c.Run(ctx))
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM credits`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("credits:", n)
	// Output:
	// offset 0 (m-1): executed
	// offset 1 (m-1): replayed
	// offset 2 (m-2): executed
	// offset 2 dead-lettered: "oops" is not an amount
	// context canceled
	// credits: 1
}

// Once the cause of the dead letters is fixed (the handler, or the data it
// needed), an operator's tool reads the dead-letter topic and redrives each
// record with the consumer that dead-lettered it: each is applied once,
// however often the tool runs.
func ExampleConsumer_Redrive() {
	var (
		ctx     context.Context
		brokers []string
		c       *idempotencykafka.Consumer // the group's consumer, as in Example
	)
	dead, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics("payments.dead-letter"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		log.Fatal(err)
	}
	defer dead.Close()
	for {
		fetches := dead.PollFetches(ctx)
		if err := fetches.Err0(); err != nil {
			log.Fatal(err)
		}
		fetches.EachRecord(func(dl *kgo.Record) {
			if err := c.Redrive(ctx, dl); err != nil {
				log.Printf("not redriven: %v", err) // applied already, another scope's, or without its value
			}
		})
	}
}
