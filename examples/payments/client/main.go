// Command client charges an account through the example PaymentService,
// using the idempotency client interceptor (one key, retried under it),
// then prints the account's balance.
//
//	go -C examples/payments run ./client -account acct-1 -amount 250     (at the repository's root)
//
// Run it twice with the same -key to see the second charge replayed.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "PaymentService address")
	account := flag.String("account", "acct-1", "account to charge")
	amount := flag.Int64("amount", 100, "amount in cents")
	key := flag.String("key", "", "idempotency key (default: a new UUIDv7)")
	flag.Parse()

	conn, err := grpc.NewClient(*addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if *key != "" {
		ctx = idempotency.WithOutgoingKey(ctx, *key)
	}
	var used string
	var trailer metadata.MD
	resp, err := client.Charge(ctx, &paymentsv1.ChargeRequest{AccountId: *account, AmountCents: *amount},
		idempotency.CaptureKey(&used), grpc.Trailer(&trailer))
	if err != nil {
		log.Fatalf("charge (key %s): %v", used, err)
	}
	replayed := len(trailer.Get(idempotency.ReplayedTrailer)) > 0
	fmt.Printf("charge %s: %d cents to %s, balance %d (key %s, replayed %v)\n",
		resp.GetChargeId(), resp.GetAmountCents(), resp.GetAccountId(), resp.GetBalanceCents(), used, replayed)

	bal, err := client.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: *account})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("account %s: balance %d cents over %d charges\n", bal.GetAccountId(), bal.GetBalanceCents(), bal.GetCharges())
}
