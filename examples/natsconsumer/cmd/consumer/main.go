// Command consumer applies the credits of a JetStream stream to PostgreSQL,
// each message exactly once, and logs what it did with every delivery.
//
//	go -C examples/natsconsumer run ./cmd/consumer -stream CREDITS -durable credits-applier
//
// It creates the stream (when missing), the durable consumer, the key table
// and the credit tables. Run several at once to share the work; stop one
// with Ctrl-C at any moment and start it again: no credit is lost or doubled.
package main

import (
	"context"
	"errors"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/natsconsumer"
	"github.com/exactlyonce/idempotency/internal/dburl"
)

func main() {
	natsURL := flag.String("nats-url", envOr("NATS_URL", nats.DefaultURL), "NATS server (env NATS_URL)")
	databaseURL := flag.String("database-url", "", dburl.Usage())
	stream := flag.String("stream", "CREDITS", "JetStream stream")
	subject := flag.String("subject", "credits.>", "subjects of the stream, when it has to be created")
	durable := flag.String("durable", "credits-applier", "durable consumer name; consumers with the same name share the work")
	ackWait := flag.Duration("ack-wait", 30*time.Second, "redeliver a message not acknowledged within this time")
	flag.Parse()
	if *databaseURL == "" {
		*databaseURL = dburl.URL()
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *natsURL, *databaseURL, *stream, *subject, *durable, *ackWait); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func run(ctx context.Context, natsURL, databaseURL, stream, subject, durable string, ackWait time.Duration) error {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	if err := natsconsumer.CreateCreditTables(ctx, pool); err != nil {
		return err
	}
	go func() { _ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { log.Print(err) }) }()

	nc, err := nats.Connect(natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:   durable,
		AckPolicy: jetstream.AckExplicitPolicy,
		AckWait:   ackWait,
	})
	if err != nil {
		return err
	}
	c, err := natsconsumer.New(store, cons, natsconsumer.ApplyCredit, natsconsumer.WithOutcomeHook(logDelivery))
	if err != nil {
		return err
	}
	log.Printf("consuming %s as %s", stream, durable)
	return c.Run(ctx)
}

func logDelivery(d natsconsumer.Delivery) {
	msg := ""
	if d.Err != nil {
		msg = ": " + d.Err.Error()
	}
	if d.AckErr != nil {
		msg += " (acknowledgement failed, redelivered later: " + d.AckErr.Error() + ")"
	}
	log.Printf("seq %d delivery %d id %s: %v%s", d.Sequence, d.NumDelivered, d.ID, d.Outcome, msg)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
