package idempotency

import (
	"reflect"
	"unsafe"

	"github.com/jackc/pgx/v5"
)

// largeObjectsOf returns pgx's large-object API on tx, one of the call's
// own transactions, so that large objects go through the same checks as
// every other statement of the call and die with it (pgx.ErrTxClosed once
// the call or the savepoint is over).
//
// pgx builds a LargeObjects only around its own Tx types, in a struct
// whose one field is the Tx its statements go through. No exported
// constructor exists, so the field is set directly; largeObjectsLayout
// checks, once, that the struct still is exactly that, and
// TestUnitLargeObjectsLayout fails the build's tests if a pgx release
// changes it.
func largeObjectsOf(tx pgx.Tx) pgx.LargeObjects {
	var lo pgx.LargeObjects
	if !largeObjectsLayout {
		panic("idempotency: this version of pgx changed pgx.LargeObjects; large objects cannot be used in an idempotent call until the idempotency module is updated")
	}
	*(*pgx.Tx)(unsafe.Pointer(&lo)) = tx
	return lo
}

// largeObjectsLayout reports whether pgx.LargeObjects is a struct holding
// nothing but a pgx.Tx.
var largeObjectsLayout = func() bool {
	t := reflect.TypeFor[pgx.LargeObjects]()
	txType := reflect.TypeFor[pgx.Tx]()
	return t.Kind() == reflect.Struct && t.NumField() == 1 && t.Field(0).Type == txType && t.Size() == txType.Size()
}()
