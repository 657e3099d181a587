// Command publisher publishes one credit with a Nats-Msg-Id, as many times
// as asked, so that the consumer can be seen applying it once. Start the
// consumer first: it creates the stream.
//
//	go -C examples/natsconsumer run ./cmd/publisher -id order-42 -account acct-1 -amount-cents 2500 -times 3
//
// Publishing the same -id again later, after the stream's duplicate window
// (two minutes by default), stores a second copy; the consumer skips it.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

func main() {
	natsURL := flag.String("nats-url", envOr("NATS_URL", nats.DefaultURL), "NATS server (env NATS_URL)")
	subject := flag.String("subject", "credits.new", "subject to publish on; the consumer creates a stream for credits.>")
	// No default: an ID made up per run (the clock, a random value) would be
	// another message each time the command is run again after a publish
	// whose acknowledgement was lost, and the credit would be applied twice.
	id := flag.String("id", "", "message ID (Nats-Msg-Id), required: the same ID for every publish of one credit, on every run")
	account := flag.String("account", "acct-1", "account to credit")
	amount := flag.Int64("amount-cents", 100, "amount to credit, in cents")
	times := flag.Int("times", 1, "how many times to publish the same message")
	flag.Parse()
	if *id == "" {
		fmt.Fprintln(os.Stderr, "publisher: -id is required: name the credit (an order number, a transfer ID), the same on every run that publishes it")
		flag.Usage()
		os.Exit(2)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, *natsURL, *subject, *id, natsconsumer.Credit{Account: *account, AmountCents: *amount}, *times); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, natsURL, subject, id string, c natsconsumer.Credit, times int) error {
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	body, err := json.Marshal(c)
	if err != nil {
		return err
	}
	for range times {
		// Retrying a failed publish with the same ID would be just as safe.
		ack, err := natsconsumer.Publish(ctx, js, subject, id, body)
		if err != nil {
			return err
		}
		log.Printf("%s: stream %s sequence %d, dropped by JetStream as a duplicate: %v", id, ack.Stream, ack.Sequence, ack.Duplicate)
	}
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
