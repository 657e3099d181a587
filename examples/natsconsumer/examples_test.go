package natsconsumer_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// A consumer that credits accounts once per message, however often
// JetStream delivers it.
func ExampleConsumer() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}

	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "CREDITS", jetstream.ConsumerConfig{
		Durable:   "credits-applier",
		AckPolicy: jetstream.AckExplicitPolicy, // required: ack each message after its commit
		AckWait:   30 * time.Second,            // longer than the slowest handler
	})
	if err != nil {
		log.Fatal(err)
	}

	c, err := natsconsumer.New(store, cons, natsconsumer.ApplyCredit,
		natsconsumer.WithOutcomeHook(func(d natsconsumer.Delivery) {
			log.Printf("seq %d (delivery %d) %s: %v", d.Sequence, d.NumDelivered, d.ID, d.Outcome)
		}))
	if err != nil {
		log.Fatal(err)
	}
	log.Print(c.Run(ctx))
}

// A publisher sets the ID the consumer deduplicates by. Retrying a publish
// with the same ID is always safe.
func ExamplePublish() {
	ctx := context.Background()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	ack, err := natsconsumer.Publish(ctx, js, "credits.new", "order-42", []byte(`{"account":"acct-1","amount_cents":2500}`))
	if err != nil {
		log.Fatal(err) // publish again with the same ID
	}
	log.Printf("stored as %d (dropped as a duplicate: %v)", ack.Sequence, ack.Duplicate)
}
